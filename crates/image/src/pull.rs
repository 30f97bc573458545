//! `warden image pull REF`: an image fetched from a registry (the OCI distribution API: the
//! token handshake, manifests, blobs and the registry's redirects of them, spoken with reqwest;
//! references parsed by the `oci-client` crate) into a staging OCI image layout, then imported
//! from it like any other layout, so that every check of an import holds for a pull as well:
//! each blob against its digest (the manifest's too), each layer against its configuration's
//! diff id, every entry of every layer (see `extract`).
//!
//! An index (a multi-platform image) is resolved here to the manifest for linux on this
//! machine's architecture, or for the platform asked; only that manifest, its configuration
//! and its layers are fetched. A blob the registry sends longer than its descriptor says is cut
//! off and refused; so is a manifest past 4 MiB and a sign-in answer past 64 KiB, as they
//! stream: a registry cannot make the warden read without end. Nothing is kept of a pull that
//! fails.

use std::path::Path;

use oci_client::Reference;
use oci_client::manifest::{
    IMAGE_MANIFEST_LIST_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE,
};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt as _;

use crate::{Image, ImageError, Store};

/// The most bytes of a manifest or an index (the distribution spec suggests 4 MiB).
const MANIFEST_LIMIT: usize = 4 << 20;
/// The most bytes of an image's configuration.
const CONFIG_LIMIT: u64 = 8 << 20;
/// The most bytes of a sign-in answer (a token in a small JSON document).
const TOKEN_LIMIT: usize = 64 << 10;

/// How to reach the registry.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    /// `OS/ARCH[/VARIANT]` of the manifest to take from an index; default `linux/` and this
    /// machine's architecture.
    pub platform: Option<String>,
    /// Registries (`HOST[:PORT]`) spoken to in plain HTTP, for a registry of one's own without
    /// TLS; every other is HTTPS, verified against the host's roots.
    pub insecure: Vec<String>,
    /// User and password (or token) for the registry; anonymous when absent.
    pub login: Option<(String, String)>,
}

/// What a pull fetched, beside the image it imported.
#[derive(Debug, Clone)]
pub struct Pulled {
    pub image: Image,
    /// The reference as the registry resolved it (`registry/repository:tag`).
    pub reference: String,
    /// The digest of the manifest taken (the platform's, under an index).
    pub manifest: String,
    /// Bytes fetched: manifest, configuration and layers as sent.
    pub fetched: u64,
}

impl Store {
    /// Fetches `reference` (`python:3.12-slim`, `registry.example/tools/base@sha256:...`) from
    /// its registry and imports it as `name`, by default the reference as given.
    pub fn pull(
        &self,
        reference: &str,
        name: Option<&str>,
        options: &PullOptions,
    ) -> Result<Pulled, ImageError> {
        let parsed: Reference = reference.parse().map_err(|e| {
            ImageError::BadName(format!(
                "{reference:?} is not an image reference ({e}): write it as [REGISTRY/]REPOSITORY[:TAG][@DIGEST], like python:3.12-slim"
            ))
        })?;
        let name = name.unwrap_or(reference);
        crate::check_name(name)?;
        if self.get(name).is_ok() {
            return Err(ImageError::Exists(name.to_owned()));
        }
        let platform = Platform::parse(options.platform.as_deref())?;
        std::fs::create_dir_all(self.root())
            .map_err(|e| ImageError::io("creating the image store", self.root(), e))?;
        // The layout is staged in the store (same file system as the layers it feeds) and goes
        // whatever happens.
        let staging = staging_dir(self.root())?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ImageError::io("starting the pull's runtime", self.root(), e))?;
        let fetched = runtime.block_on(fetch(
            &parsed,
            &platform,
            options,
            staging.path(),
            layer_blob_limit(self.limits),
        ))?;
        let image = self.import(staging.path(), Some(name))?;
        Ok(Pulled {
            image,
            reference: parsed.whole(),
            manifest: fetched.manifest,
            fetched: fetched.bytes,
        })
    }
}

/// A pull's staging folder, removed when dropped; `.pull-ID` in the store, beside its lock
/// `.pull-ID.lock`, held (`flock`) for as long as the pull runs, so that a later pull can tell a
/// killed one's folder (its lock free) from a running one's (see `sweep_killed_pulls`).
struct Staging {
    dir: std::path::PathBuf,
    lock: std::path::PathBuf,
    _held: std::fs::File,
}

impl Staging {
    fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.lock);
    }
}

fn staging_dir(root: &Path) -> Result<Staging, ImageError> {
    use std::time::{SystemTime, UNIX_EPOCH};
    sweep_killed_pulls(root);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = root.join(format!(".pull-{}-{nanos}", std::process::id()));
    let lock = dir.with_extension("lock");
    // The lock first, then the folder: a folder is never without its held lock.
    let held = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock)
        .and_then(|file| {
            rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
            Ok(file)
        })
        .map_err(|e| ImageError::io("locking the pull's staging folder", &lock, e))?;
    let staging = Staging {
        dir,
        lock,
        _held: held,
    };
    std::fs::create_dir_all(staging.dir.join("blobs").join("sha256"))
        .map_err(|e| ImageError::io("creating the pull's staging folder", &staging.dir, e))?;
    Ok(staging)
}

/// Removes what pulls that were killed left in the store: each `.pull-ID` whose lock no
/// process holds (a pull killed by a timeout had left gigabytes there for good).
pub(crate) fn sweep_killed_pulls(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Some(id) = name
            .strip_prefix(".pull-")
            .and_then(|rest| rest.strip_suffix(".lock"))
        else {
            continue;
        };
        let Ok(file) = std::fs::OpenOptions::new().write(true).open(entry.path()) else {
            continue;
        };
        if rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok() {
            let _ = crate::remove_tree(&root.join(format!(".pull-{id}")));
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The platform whose manifest is taken from an index.
#[derive(Debug, Clone)]
struct Platform {
    os: String,
    architecture: String,
    variant: Option<String>,
}

impl Platform {
    fn parse(text: Option<&str>) -> Result<Self, ImageError> {
        let Some(text) = text else {
            return Ok(Self {
                os: "linux".to_owned(),
                architecture: crate::archive::host_arch().to_owned(),
                variant: None,
            });
        };
        let parts: Vec<&str> = text.split('/').collect();
        match parts.as_slice() {
            [os, arch] | [os, arch, _] if !os.is_empty() && !arch.is_empty() => Ok(Self {
                os: (*os).to_owned(),
                architecture: (*arch).to_owned(),
                variant: parts.get(2).map(|v| (*v).to_owned()),
            }),
            _ => Err(ImageError::BadName(format!(
                "--platform {text:?}: write it as OS/ARCH[/VARIANT], like linux/amd64 or linux/arm64/v8"
            ))),
        }
    }

    fn matches(&self, entry: &Value) -> bool {
        let p = &entry["platform"];
        p["os"] == self.os.as_str()
            && p["architecture"] == self.architecture.as_str()
            && self.variant.as_deref().is_none_or(|v| p["variant"] == v)
    }

    fn shown(&self) -> String {
        match &self.variant {
            Some(v) => format!("{}/{}/{v}", self.os, self.architecture),
            None => format!("{}/{}", self.os, self.architecture),
        }
    }
}

struct Fetched {
    manifest: String,
    bytes: u64,
}

/// The most bytes a layer's blob may be: the files a layer may hold, and room for its tar's
/// headers (a block or two each, however many entries it may have). A manifest that names a
/// bigger blob is refused before any blob is fetched: the registry picks the size, and would
/// otherwise fill the store's disk by streaming one blob without end.
fn layer_blob_limit(limits: crate::Limits) -> u64 {
    limits
        .bytes
        .saturating_add(limits.entries.saturating_mul(1024))
        .saturating_add(1 << 20)
}

async fn fetch(
    reference: &Reference,
    platform: &Platform,
    options: &PullOptions,
    dir: &Path,
    layer_limit: u64,
) -> Result<Fetched, ImageError> {
    // One process-wide TLS provider; another part of the warden may have set it already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let accepted = [
        OCI_IMAGE_INDEX_MEDIA_TYPE,
        IMAGE_MANIFEST_LIST_MEDIA_TYPE,
        OCI_IMAGE_MEDIA_TYPE,
        IMAGE_MANIFEST_MEDIA_TYPE,
    ];
    let mut fetched = 0u64;
    let mut target = reference.clone();
    // Redirects (of blobs, to a store of the registry's) are followed, at most 10, and carry
    // no credentials to another host.
    let http = reqwest::Client::builder()
        .connect_timeout(std::time::Duration::from_secs(15))
        .read_timeout(std::time::Duration::from_secs(60))
        .redirect(reqwest::redirect::Policy::limited(10))
        .build()
        .map_err(|e| ImageError::Format(format!("making the registry's client: {e}")))?;
    let scheme = if options
        .insecure
        .iter()
        .any(|r| r == reference.resolve_registry())
    {
        "http"
    } else {
        "https"
    };
    let registry = Registry {
        http,
        base: format!("{scheme}://{}", reference.resolve_registry()),
        auth: Auth::None,
    };
    let registry = Registry {
        auth: sign_in(&registry, reference, options.login.as_ref()).await?,
        ..registry
    };
    let (raw, digest, document) = loop {
        let url = format!(
            "{}/v2/{}/manifests/{}",
            registry.base,
            reference.repository(),
            target.digest().or(target.tag()).unwrap_or("latest")
        );
        let request = registry.get(&url).header("Accept", accepted.join(", "));
        let raw = read_manifest(request, reference, &url).await?;
        let digest = format!(
            "sha256:{}",
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&raw))
        );
        if let Some(asked) = target.digest()
            && asked != digest
        {
            return Err(ImageError::Digest {
                what: format!("the manifest of {}", reference.whole()),
                expected: asked.to_owned(),
                got: digest,
            });
        }
        fetched += raw.len() as u64;
        let document: Value = serde_json::from_slice(&raw).map_err(|e| {
            ImageError::Format(format!("the manifest {digest} does not parse: {e}"))
        })?;
        let is_index = matches!(
            document["mediaType"].as_str(),
            Some(OCI_IMAGE_INDEX_MEDIA_TYPE | IMAGE_MANIFEST_LIST_MEDIA_TYPE)
        ) || (document.get("manifests").is_some()
            && document.get("layers").is_none());
        if !is_index {
            break (raw, digest, document);
        }
        if target.digest().is_some() && target.digest() != reference.digest() {
            return Err(ImageError::Format(format!(
                "the registry's index for {} names another index",
                reference.whole()
            )));
        }
        let entries = document["manifests"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let Some(chosen) = entries.iter().find(|e| platform.matches(e)) else {
            let offered: Vec<String> = entries
                .iter()
                .filter_map(|e| {
                    let p = &e["platform"];
                    Some(format!(
                        "{}/{}",
                        p["os"].as_str()?,
                        p["architecture"].as_str()?
                    ))
                })
                .collect();
            return Err(ImageError::Format(format!(
                "{} has no manifest for {} (it has {}); name one with --platform",
                reference.whole(),
                platform.shown(),
                offered.join(", ")
            )));
        };
        let Some(chosen) = chosen["digest"].as_str() else {
            return Err(ImageError::Format(format!(
                "the index for {} has an entry without a digest",
                reference.whole()
            )));
        };
        target = Reference::with_digest(
            reference.registry().to_owned(),
            reference.repository().to_owned(),
            chosen.to_owned(),
        );
    };
    // The manifest exactly as sent: the layout's index names it by this digest, which the
    // import checks against its bytes.
    write_blob(dir, &digest, &raw)?;
    let media_type = document["mediaType"]
        .as_str()
        .unwrap_or(OCI_IMAGE_MEDIA_TYPE)
        .to_owned();
    let config = descriptor(&document["config"], "its configuration")?;
    if config.size > CONFIG_LIMIT {
        return Err(ImageError::Format(format!(
            "the image's configuration is said to be {} bytes, more than the {CONFIG_LIMIT} one may be",
            config.size
        )));
    }
    let layers = document["layers"]
        .as_array()
        .ok_or_else(|| ImageError::Format(format!("the manifest {digest} lists no layers")))?
        .iter()
        .map(|l| descriptor(l, "a layer"))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some((i, big)) = layers
        .iter()
        .enumerate()
        .find(|(_, l)| l.size > layer_limit)
    {
        return Err(ImageError::Format(format!(
            "the manifest {digest} says layer {} ({}) is {} bytes, more than the {layer_limit} a layer may be (the store's limit of one layer's files and their headers); nothing was fetched",
            i + 1,
            big.digest,
            big.size
        )));
    }
    for (i, blob) in std::iter::once(&config).chain(&layers).enumerate() {
        let what = match i {
            0 => "its configuration".to_owned(),
            n => format!("layer {n} ({})", blob.digest),
        };
        fetched += pull_blob(&registry, &target, blob, dir, &what).await?;
    }
    let tag = reference.tag().unwrap_or("latest");
    let index = json!({
        "schemaVersion": 2,
        "mediaType": OCI_IMAGE_INDEX_MEDIA_TYPE,
        "manifests": [{
            "mediaType": media_type,
            "digest": digest,
            "size": raw.len(),
            "annotations": { "org.opencontainers.image.ref.name": tag },
        }],
    });
    write_file(&dir.join("index.json"), index.to_string().as_bytes())?;
    write_file(
        &dir.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    Ok(Fetched {
        manifest: digest,
        bytes: fetched,
    })
}

/// How the warden signs its requests to the registry. (No `Debug`: it holds secrets.)
enum Auth {
    None,
    Basic(String, String),
    Bearer(String),
}

/// A registry, and how to ask it.
struct Registry {
    http: reqwest::Client,
    /// `SCHEME://HOST[:PORT]`.
    base: String,
    auth: Auth,
}

impl Registry {
    /// A GET signed for the registry (the client drops the credentials on a redirect to
    /// another host).
    fn get(&self, url: &str) -> reqwest::RequestBuilder {
        let request = self.http.get(url);
        match &self.auth {
            Auth::None => request,
            Auth::Basic(user, password) => request.basic_auth(user, Some(password)),
            Auth::Bearer(token) => request.bearer_auth(token),
        }
    }
}

/// How to sign in for pulling `reference`, as the registry's `GET /v2/` says: nothing when it
/// asks for nothing; the login as HTTP Basic when it asks for that; else (a `Bearer` challenge)
/// a token from the challenge's realm, asked with the login if there is one, for the scope
/// `repository:REPO:pull`. The realm's answer is read up to [`TOKEN_LIMIT`] bytes.
async fn sign_in(
    registry: &Registry,
    reference: &Reference,
    login: Option<&(String, String)>,
) -> Result<Auth, ImageError> {
    let fail = |what: String| {
        ImageError::Format(format!(
            "pulling {} from {}: signing in: {what}",
            reference.whole(),
            reference.resolve_registry()
        ))
    };
    let url = format!("{}/v2/", registry.base);
    // Its body is not read.
    let answer = registry
        .http
        .get(&url)
        .send()
        .await
        .map_err(|e| fail(format!("{url}: {e}")))?;
    let basic = || match login {
        Some((user, password)) => Auth::Basic(user.clone(), password.clone()),
        None => Auth::None,
    };
    if answer.status() != reqwest::StatusCode::UNAUTHORIZED {
        return Ok(basic());
    }
    let challenge = answer
        .headers()
        .get_all(reqwest::header::WWW_AUTHENTICATE)
        .iter()
        .filter_map(|h| h.to_str().ok())
        .find_map(bearer_challenge);
    drop(answer);
    let Some(challenge) = challenge else {
        return Ok(basic());
    };
    let Some(realm) = challenge.get("realm") else {
        return Err(fail(
            "the registry's Bearer challenge names no realm".to_owned(),
        ));
    };
    let mut realm = reqwest::Url::parse(realm)
        .map_err(|e| fail(format!("the registry's sign-in address {realm:?}: {e}")))?;
    // Plain HTTP only for a registry spoken to in plain HTTP (`--insecure-registry`): an HTTPS
    // registry may not send the login, or the token, over the clear.
    let plain_allowed = registry.base.starts_with("http://");
    if !(realm.scheme() == "https" || (realm.scheme() == "http" && plain_allowed)) {
        return Err(fail(format!(
            "the registry sends the sign-in to {realm}, which is not HTTPS{}",
            if realm.scheme() == "http" {
                " (only a registry named with --insecure-registry may)"
            } else {
                ""
            }
        )));
    }
    {
        let mut query = realm.query_pairs_mut();
        query.append_pair(
            "scope",
            &format!("repository:{}:pull", reference.repository()),
        );
        if let Some(service) = challenge.get("service") {
            query.append_pair("service", service);
        }
    }
    let mut request = registry.http.get(realm.clone());
    if let Some((user, password)) = login {
        request = request.basic_auth(user, Some(password));
    }
    let response = request
        .send()
        .await
        .map_err(|e| fail(format!("{realm}: {e}")))?;
    let status = response.status();
    let body = read_bounded(response, TOKEN_LIMIT)
        .await
        .map_err(|e| fail(format!("{realm}: {e}")))?;
    if !status.is_success() {
        let said = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
        return Err(fail(format!(
            "{realm} answered {status}{}: {said}",
            if login.is_none() {
                " (a private image needs WARDEN_REGISTRY_USER and WARDEN_REGISTRY_PASSWORD)"
            } else {
                ""
            }
        )));
    }
    let document: Value = serde_json::from_slice(&body)
        .map_err(|e| fail(format!("{realm} answered what is not JSON: {e}")))?;
    match document["token"]
        .as_str()
        .or(document["access_token"].as_str())
    {
        Some(token) if !token.is_empty() => Ok(Auth::Bearer(token.to_owned())),
        _ => Err(fail(format!("{realm} answered no token"))),
    }
}

/// The parameters of a `Bearer` challenge (`Bearer realm="...",service="...",scope="..."`);
/// `None` for a challenge of another scheme.
fn bearer_challenge(header: &str) -> Option<std::collections::HashMap<String, String>> {
    let (scheme, rest) = header.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut params = std::collections::HashMap::new();
    let mut rest = rest.trim_start();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let key = key.trim().to_ascii_lowercase();
        let (value, after) = match after.strip_prefix('"') {
            Some(quoted) => {
                // A quoted string, with backslash escapes.
                let mut value = String::new();
                let mut chars = quoted.char_indices();
                let mut end = None;
                while let Some((i, c)) = chars.next() {
                    match c {
                        '\\' => value.extend(chars.next().map(|(_, c)| c)),
                        '"' => {
                            end = Some(i + 1);
                            break;
                        }
                        c => value.push(c),
                    }
                }
                (value, &quoted[end?..])
            }
            None => {
                let end = after.find(',').unwrap_or(after.len());
                (after[..end].trim().to_owned(), &after[end..])
            }
        };
        params.insert(key, value);
        rest = after.trim_start().trim_start_matches(',').trim_start();
    }
    Some(params)
}

/// Why a body was not read whole.
enum Unread {
    /// It passed the limit (announced or sent).
    TooLarge(usize),
    /// The connection failed.
    Failed(String),
}

impl std::fmt::Display for Unread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooLarge(limit) => {
                write!(f, "the answer is more than the {limit} bytes it may be")
            }
            Self::Failed(why) => f.write_str(why),
        }
    }
}

/// A response's body, refused once it passes `limit` bytes (announced or sent) without
/// reading further.
async fn read_bounded(response: reqwest::Response, limit: usize) -> Result<Vec<u8>, Unread> {
    use futures_util::StreamExt as _;
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Err(Unread::TooLarge(limit));
    }
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| Unread::Failed(e.to_string()))?;
        if body.len() + chunk.len() > limit {
            return Err(Unread::TooLarge(limit));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The first `limit` bytes of a response's body, or fewer: what an error answer says, for a
/// message. The rest is not read.
async fn read_prefix(response: reqwest::Response, limit: usize) -> Vec<u8> {
    use futures_util::StreamExt as _;
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while body.len() < limit {
        match stream.next().await {
            Some(Ok(chunk)) => {
                body.extend_from_slice(&chunk[..chunk.len().min(limit - body.len())])
            }
            _ => break,
        }
    }
    body
}

/// A manifest's bytes as the registry sends them, refused past [`MANIFEST_LIMIT`] without
/// reading further.
async fn read_manifest(
    request: reqwest::RequestBuilder,
    reference: &Reference,
    url: &str,
) -> Result<Vec<u8>, ImageError> {
    let failed = |e: String| {
        ImageError::Format(format!(
            "pulling {} from {}: its manifest ({url}): {e}",
            reference.whole(),
            reference.resolve_registry()
        ))
    };
    let response = request.send().await.map_err(|e| failed(e.to_string()))?;
    let status = response.status();
    let body = read_bounded(response, MANIFEST_LIMIT)
        .await
        .map_err(|e| match e {
            Unread::TooLarge(_) => ImageError::Format(format!(
                "the registry's manifest for {} is more than the {MANIFEST_LIMIT} bytes a manifest may be",
                reference.whole()
            )),
            Unread::Failed(why) => failed(why),
        })?;
    if !status.is_success() {
        let said = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
        let hint = match status.as_u16() {
            401 | 403 => {
                " (a private image needs WARDEN_REGISTRY_USER and WARDEN_REGISTRY_PASSWORD)"
            }
            404 => " (no such repository or tag)",
            _ => "",
        };
        return Err(ImageError::Format(format!(
            "pulling {} from {}: its manifest: the registry answered {status}{hint}: {said}",
            reference.whole(),
            reference.resolve_registry()
        )));
    }
    Ok(body)
}

/// A blob as a manifest names it.
struct Blob {
    digest: String,
    size: u64,
}

fn descriptor(value: &Value, what: &str) -> Result<Blob, ImageError> {
    let digest = value["digest"].as_str().unwrap_or_default();
    if crate::sha256_hex(digest).is_none() {
        return Err(ImageError::Format(format!(
            "the manifest names {what} by {digest:?}, not a sha256 digest"
        )));
    }
    Ok(Blob {
        digest: digest.to_owned(),
        size: value["size"].as_u64().unwrap_or(0),
    })
}

/// Streams one blob into the layout, refusing more bytes than its descriptor names; returns
/// the bytes written.
async fn pull_blob(
    registry: &Registry,
    reference: &Reference,
    blob: &Blob,
    dir: &Path,
    what: &str,
) -> Result<u64, ImageError> {
    use futures_util::StreamExt as _;
    let hex = crate::sha256_hex(&blob.digest).unwrap_or_default();
    let path = dir.join("blobs").join("sha256").join(hex);
    let url = format!(
        "{}/v2/{}/blobs/{}",
        registry.base,
        reference.repository(),
        blob.digest
    );
    let failed = |e: String| {
        ImageError::Format(format!(
            "pulling {} from {}: {what}: {e}",
            reference.whole(),
            reference.resolve_registry()
        ))
    };
    let response = registry
        .get(&url)
        .send()
        .await
        .map_err(|e| failed(e.to_string()))?;
    let status = response.status();
    if !status.is_success() {
        let said = String::from_utf8_lossy(&read_prefix(response, 512).await).into_owned();
        return Err(failed(format!("the registry answered {status}: {said}")));
    }
    if let Some(length) = response.content_length().filter(|n| *n > blob.size) {
        return Err(ImageError::Format(format!(
            "the registry announces {length} bytes of {what}, more than the {} its manifest names",
            blob.size
        )));
    }
    let mut stream = response.bytes_stream();
    let mut file = tokio::fs::File::create(&path)
        .await
        .map_err(|e| ImageError::io("writing a pulled blob", &path, e))?;
    let mut written = 0u64;
    let mut hashing = <sha2::Sha256 as sha2::Digest>::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ImageError::Format(format!("receiving {what}: {e}")))?;
        written += chunk.len() as u64;
        if written > blob.size {
            return Err(ImageError::Format(format!(
                "the registry sent more of {what} than the {} bytes its manifest names",
                blob.size
            )));
        }
        sha2::Digest::update(&mut hashing, &chunk);
        file.write_all(&chunk)
            .await
            .map_err(|e| ImageError::io("writing a pulled blob", &path, e))?;
    }
    file.flush()
        .await
        .map_err(|e| ImageError::io("writing a pulled blob", &path, e))?;
    if written != blob.size {
        return Err(ImageError::Format(format!(
            "the registry sent {written} bytes of {what}, not the {} its manifest names",
            blob.size
        )));
    }
    // Checked here, before anything is unpacked (the import checks it again).
    let got = format!("sha256:{}", hex::encode(sha2::Digest::finalize(hashing)));
    if got != blob.digest {
        return Err(ImageError::Digest {
            what: format!("{what}, as the registry sent it,"),
            expected: blob.digest.clone(),
            got,
        });
    }
    Ok(written)
}

fn write_blob(dir: &Path, digest: &str, bytes: &[u8]) -> Result<(), ImageError> {
    let hex = crate::sha256_hex(digest).ok_or_else(|| {
        ImageError::Format(format!(
            "the registry named the manifest by {digest:?}, not a sha256 digest"
        ))
    })?;
    write_file(&dir.join("blobs").join("sha256").join(hex), bytes)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ImageError> {
    std::fs::write(path, bytes).map_err(|e| ImageError::io("writing the pulled layout", path, e))
}

#[cfg(test)]
mod tests {
    use super::bearer_challenge;

    /// A registry on loopback that answers `/v2/` and one manifest, and records every other
    /// request (answered 404).
    fn registry(manifest: String) -> (u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use std::io::{BufRead as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = asked.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let path = line.split(' ').nth(1).unwrap_or_default().to_owned();
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap() <= 2 {
                        break;
                    }
                }
                let (status, body) = match path.as_str() {
                    "/v2/" => ("200 OK", "{}".to_owned()),
                    "/v2/test/img/manifests/1" => ("200 OK", manifest.clone()),
                    _ => {
                        record.lock().unwrap().push(path);
                        ("404 Not Found", String::new())
                    }
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (port, asked)
    }

    #[test]
    fn a_layer_bigger_than_a_layer_may_be_is_never_fetched() {
        // The registry names the size; once streamed to disk without end.
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{}", "1".repeat(64)), "size": 100 },
            "layers": [{ "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": format!("sha256:{}", "0".repeat(64)), "size": 1u64 << 50 }],
        })
        .to_string();
        let (port, asked) = registry(manifest);
        let tmp = tempfile::tempdir().unwrap();
        let store = crate::Store::new(tmp.path()).with_limits(crate::Limits {
            bytes: 1 << 20,
            entries: 100,
        });
        let options = super::PullOptions {
            insecure: vec![format!("127.0.0.1:{port}")],
            ..Default::default()
        };
        let err = store
            .pull(
                &format!("127.0.0.1:{port}/test/img:1"),
                Some("big:1"),
                &options,
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is 1125899906842624 bytes, more than the 2199552 a layer may be"),
            "{err}"
        );
        assert!(
            asked.lock().unwrap().is_empty(),
            "{:?}",
            asked.lock().unwrap()
        );
        assert!(store.list().unwrap().is_empty());
    }

    #[test]
    fn a_bearer_challenge_is_read_with_its_quoted_parameters() {
        let c = bearer_challenge(
            r#"Bearer realm="https://auth.example/token",service="reg, \"one\"",scope=repository:a/b:pull"#,
        )
        .unwrap();
        assert_eq!(c["realm"], "https://auth.example/token");
        assert_eq!(c["service"], r#"reg, "one""#);
        assert_eq!(c["scope"], "repository:a/b:pull");
        assert!(bearer_challenge(r#"Basic realm="registry""#).is_none());
        // An unterminated quote is no challenge at all.
        assert!(bearer_challenge(r#"Bearer realm="https://auth.example"#).is_none());
    }
}
