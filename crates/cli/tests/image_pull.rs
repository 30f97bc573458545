//! `warden image pull` against a real registry (the `docker-registry` package: the distribution
//! project's registry, run here on loopback with its own storage): an image built in the test
//! from host files is pushed through the registry's HTTP API, pulled by tag under an index of
//! two platforms, and run as a cell; a registry whose stored layer was changed behind its back,
//! a platform the image lacks and a tag that does not exist are refused, with nothing kept. A
//! front of the test's own puts the registry behind a token service, to pull through the
//! `Bearer` sign-in, and answers a manifest or a token without end, to be cut off.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::Digest as _;
use support::*;

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

/// A registry of the test's own, killed when dropped.
struct Registry {
    child: Child,
    port: u16,
    storage: PathBuf,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Registry {
    fn start(dir: &Path) -> Self {
        let binary = ["/usr/bin/docker-registry", "/usr/bin/registry"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("the registry is installed (apt-get install docker-registry; .ci/run does it)");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let storage = dir.join("registry");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n",
                storage.display()
            ),
        )
        .unwrap();
        let child = Command::new(binary)
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let registry = Self {
            child,
            port,
            storage,
        };
        let until = Instant::now() + Duration::from_secs(20);
        while registry.request("GET", "/v2/", &[], b"").0 != 200 {
            assert!(Instant::now() < until, "the registry did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        registry
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// One HTTP/1.1 exchange: the status, the `Location` header and the body.
    fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, String, Vec<u8>) {
        let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return (0, String::new(), Vec::new());
        };
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.address(),
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        tcp.write_all(head.as_bytes()).unwrap();
        tcp.write_all(body).unwrap();
        let mut answer = Vec::new();
        let _ = tcp.read_to_end(&mut answer);
        let split = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or(answer.len());
        let head = String::from_utf8_lossy(&answer[..split]).into_owned();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let location = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("location")
                    .then(|| value.trim().to_owned())
            })
            .unwrap_or_default();
        (
            status,
            location,
            answer[(split + 4).min(answer.len())..].to_vec(),
        )
    }

    /// Uploads a blob (monolithic upload) and returns its digest.
    fn push_blob(&self, repository: &str, data: &[u8]) -> String {
        let digest = sha(data);
        let (status, location, body) = self.request(
            "POST",
            &format!("/v2/{repository}/blobs/uploads/"),
            &[],
            b"",
        );
        assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
        let path = location
            .strip_prefix(&format!("http://{}", self.address()))
            .unwrap_or(&location)
            .to_owned();
        let joiner = if path.contains('?') { '&' } else { '?' };
        let (status, _, body) = self.request(
            "PUT",
            &format!("{path}{joiner}digest={digest}"),
            &[("Content-Type", "application/octet-stream")],
            data,
        );
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
        digest
    }

    fn push_manifest(&self, repository: &str, reference: &str, kind: &str, doc: &Value) -> String {
        let bytes = doc.to_string().into_bytes();
        let (status, _, body) = self.request(
            "PUT",
            &format!("/v2/{repository}/manifests/{reference}"),
            &[("Content-Type", kind)],
            &bytes,
        );
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
        sha(&bytes)
    }

    /// Pushes an image of these (uncompressed) layers, gzipped as registries serve them, and
    /// returns its manifest's descriptor.
    fn push_image(&self, repository: &str, layers: &[Vec<u8>], arch: &str) -> Value {
        let mut descriptors = Vec::new();
        for layer in layers {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(layer).unwrap();
            let gz = gz.finish().unwrap();
            let digest = self.push_blob(repository, &gz);
            descriptors.push(json!({
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": digest, "size": gz.len(),
            }));
        }
        let config = json!({
            "architecture": arch, "os": "linux",
            "config": { "Env": ["GREETING=pulled", "PATH=/bin"], "WorkingDir": "/" },
            "rootfs": { "type": "layers", "diff_ids": layers.iter().map(|l| sha(l)).collect::<Vec<_>>() },
        })
        .to_string();
        let config_digest = self.push_blob(repository, config.as_bytes());
        let manifest = json!({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len() },
            "layers": descriptors,
        });
        let size = manifest.to_string().len();
        let digest = self.push_manifest(
            repository,
            &sha(manifest.to_string().as_bytes()),
            OCI_MANIFEST,
            &manifest,
        );
        json!({ "mediaType": OCI_MANIFEST, "digest": digest, "size": size,
                "platform": { "os": "linux", "architecture": arch } })
    }

    /// An image of one layer for this machine, tagged `1` under an index in `repository`:
    /// its layer's digest, and the file the registry keeps its bytes in.
    fn push_one_layer(&self, repository: &str) -> (String, PathBuf) {
        let pushed = self.push_image(repository, &[shell_layer(b"as pushed\n")], host_arch());
        self.push_manifest(
            repository,
            "1",
            OCI_INDEX,
            &json!({ "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [pushed] }),
        );
        let manifest_file = self.blob_file(pushed["digest"].as_str().unwrap());
        let manifest: Value =
            serde_json::from_slice(&std::fs::read(manifest_file).unwrap()).unwrap();
        let digest = manifest["layers"][0]["digest"].as_str().unwrap().to_owned();
        let file = self.blob_file(&digest);
        (digest, file)
    }

    /// Where the registry keeps a blob's bytes (its filesystem driver's layout).
    fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.storage
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

/// `/bin/sh` of the host and what `ldd` says it loads, and a file of its own.
fn shell_layer(note: &[u8]) -> Vec<u8> {
    host_shell_layer(&[("etc/note", 0o644, note)])
}

fn warden_in(state: &Path) -> Command {
    let mut cmd = warden();
    cmd.env("WARDEN_STATE_DIR", state)
        .env_remove("WARDEN_REGISTRY_USER")
        .env_remove("WARDEN_REGISTRY_PASSWORD");
    cmd
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// `warden image pull` in `state`, from the plain-HTTP registry at `address`.
fn pull_from(state: &Path, address: &str) -> Command {
    let mut cmd = warden_in(state);
    cmd.args(["image", "pull", "--insecure-registry", address]);
    cmd
}

/// Pulls `REPOSITORY:TAG` from `registry`, which must refuse it; returns what it said.
fn pull_refused(state: &Path, registry: &Registry, reference: &str) -> String {
    let refused = pull_from(state, &registry.address())
        .arg(format!("{}/{reference}", registry.address()))
        .output()
        .unwrap();
    assert!(!refused.status.success(), "{reference} was pulled");
    String::from_utf8_lossy(&refused.stderr).into_owned()
}

/// What the image store holds besides its records: nothing of a failed pull may stay.
fn store_entries(state: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for sub in ["images", "images/layers"] {
        if let Ok(entries) = std::fs::read_dir(state.join(sub)) {
            for e in entries.flatten() {
                out.push(format!("{sub}/{}", e.file_name().to_string_lossy()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn an_image_pulled_from_a_registry_runs_as_a_cell_and_a_changed_blob_is_refused() {
    let dir = tempdir();
    let registry = Registry::start(dir.path());
    let state = dir.path().join("state");
    let other = if host_arch() == "arm64" {
        "amd64"
    } else {
        "arm64"
    };
    // Two platforms under one tag: this machine's runs the host's shell; the other's only
    // says which it is.
    let ours = registry.push_image(
        "tools/mini",
        &[shell_layer(b"this platform\n")],
        host_arch(),
    );
    let theirs = registry.push_image("tools/mini", &[shell_layer(b"the other platform\n")], other);
    let index = json!({ "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [theirs, ours] });
    registry.push_manifest("tools/mini", "1", OCI_INDEX, &index);
    let reference = format!("{}/tools/mini:1", registry.address());

    let pulled = pull_from(&state, &registry.address())
        .arg("--json")
        .arg(&reference)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&pulled.stdout);
    assert!(
        pulled.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&pulled.stderr)
    );
    let pulled: Value = serde_json::from_str(&said).unwrap();
    assert_eq!(pulled["image"]["name"], reference.as_str());
    assert_eq!(
        pulled["manifest"], ours["digest"],
        "this machine's manifest was taken"
    );
    assert_eq!(pulled["image"]["layers"].as_array().unwrap().len(), 1);

    let ran = run_in_image(
        &state,
        dir.path(),
        &reference,
        "while read -r l; do echo \"$l\"; done < /etc/note; echo \"greeting=$GREETING\"",
    );
    let out = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert!(
        out.contains("this platform") && out.contains("greeting=pulled"),
        "{out}"
    );

    // The other platform, asked for by name, under another name.
    let theirs_name = "mini-other:1";
    let pulled = pull_from(&state, &registry.address())
        .args([
            "--platform",
            &format!("linux/{other}"),
            "--name",
            theirs_name,
        ])
        .arg(&reference)
        .output()
        .unwrap();
    assert!(
        pulled.status.success(),
        "{}",
        String::from_utf8_lossy(&pulled.stderr)
    );
    let before = store_entries(&state);

    // A platform the image lacks, and a tag that is not there: refused, nothing kept.
    let refused = pull_from(&state, &registry.address())
        .args(["--platform", "linux/s390x", "--name", "nope:1"])
        .arg(&reference)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        err.contains("no manifest for linux/s390x") && err.contains(&format!("linux/{other}")),
        "{err}"
    );
    let err = pull_refused(&state, &registry, "tools/mini:404");
    assert!(
        err.contains("tools/mini:404") && err.contains("nothing was kept"),
        "{err}"
    );

    // A registry whose stored layer was changed behind its back serves other bytes under the
    // same digest: the pull says so and keeps nothing.
    let (layer_digest, layer_file) = registry.push_one_layer("tools/changed");
    // One byte changed, the length kept: only the digest can tell.
    let mut bytes = std::fs::read(&layer_file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x5a;
    std::fs::write(&layer_file, &bytes).unwrap();
    let err = pull_refused(&state, &registry, "tools/changed:1");
    assert!(
        err.to_lowercase().contains("digest") && err.contains(&layer_digest),
        "{err}"
    );
    assert_eq!(
        store_entries(&state),
        before,
        "a refused pull left something"
    );

    // One that sends more than its descriptor says (the stored blob grown by 1 MiB): cut off
    // at the size named and refused.
    let (_, layer_file) = registry.push_one_layer("tools/longer");
    let mut bytes = std::fs::read(&layer_file).unwrap();
    bytes.extend(std::iter::repeat_n(0u8, 1 << 20));
    std::fs::write(&layer_file, &bytes).unwrap();
    let err = pull_refused(&state, &registry, "tools/longer:1");
    assert!(
        err.contains("more than the") && err.contains("its manifest names"),
        "{err}"
    );
    assert_eq!(
        store_entries(&state),
        before,
        "a refused pull left something"
    );

    let ls = warden_in(&state)
        .args(["image", "ls", "--json"])
        .output()
        .unwrap();
    let listed: Value = serde_json::from_slice(&ls.stdout).unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(names.contains(&reference.as_str()) && names.contains(&theirs_name));
}

/// A registry that answers a manifest with an endless body: the pull stops reading at the
/// size a manifest may be and says so, rather than filling the warden's memory.
#[test]
fn an_endless_manifest_is_cut_off() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = sent.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let counter = counter.clone();
            std::thread::spawn(move || {
                let mut conn = conn;
                let Some(head) = read_head(&mut conn) else {
                    return;
                };
                let line = head.lines().next().unwrap_or("").to_owned();
                if line.starts_with("GET /v2/ ") {
                    let _ = conn.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
                    );
                    return;
                }
                send_endless(&mut conn, OCI_MANIFEST, &counter);
            });
        }
    });
    let dir = tempdir();
    let state = dir.path().join("state");
    let started = Instant::now();
    let refused = pull_from(&state, &format!("127.0.0.1:{port}"))
        .arg(format!("127.0.0.1:{port}/endless/manifest:1"))
        .output()
        .unwrap();
    assert_cut_off(
        &refused,
        started,
        &sent,
        &state,
        &["more than the 4194304 bytes a manifest may be"],
    );
}

/// A pull refused for an answer without end: it says `said`, within 30 s, having read little
/// more than the limit (what the socket buffers held besides), and kept nothing.
fn assert_cut_off(
    refused: &std::process::Output,
    started: Instant,
    sent: &std::sync::atomic::AtomicU64,
    state: &Path,
    said: &[&str],
) {
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(said.iter().all(|s| err.contains(s)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30));
    let read = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        read < 64 << 20,
        "{read} bytes were sent before the pull stopped"
    );
    assert!(store_entries(state).iter().all(|e| !e.contains(".pull-")));
}

/// A request's head, read byte by byte up to its blank line (`None`: the client went away).
fn read_head(conn: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// Answers 200 with a chunked body of `content_type` that never ends (until the client hangs
/// up), counting the bytes sent into `counter`.
fn send_endless(conn: &mut TcpStream, content_type: &str, counter: &std::sync::atomic::AtomicU64) {
    let _ = conn.write_all(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        .as_bytes(),
    );
    let chunk = format!("10000\r\n{}\r\n", " ".repeat(0x10000));
    while conn.write_all(chunk.as_bytes()).is_ok() {
        counter.fetch_add(0x10000, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Runs `script` with `/bin/sh` in a cell on image `reference`.
fn run_in_image(state: &Path, dir: &Path, reference: &str, script: &str) -> std::process::Output {
    let policy = policy(dir, &format!("version: 1\nimage: \"{reference}\"\n"));
    warden_in(state)
        .arg("run")
        .arg("--policy")
        .arg(&policy)
        .args(["--", "/bin/sh", "-c", script])
        .output()
        .unwrap()
}

/// What the sign-in front answers at its token endpoint.
#[derive(Clone, Copy)]
enum TokenAnswer {
    /// `{"token": "granted-token"}`.
    Granted,
    /// A chunked body without end.
    Endless,
}

/// A front of the test's own before `registry` that asks for a bearer token, as a registry
/// behind a token service does: `GET /v2/` and every request without `Bearer granted-token`
/// get 401 with a `Bearer` challenge naming its `/token` endpoint; the others are passed to the
/// registry. Returns its address, the request heads it saw, and the bytes of token answer
/// it sent.
fn bearer_front(
    registry_port: u16,
    answer: TokenAnswer,
) -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (heads, counter, realm) = (seen.clone(), sent.clone(), address.clone());
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let (heads, counter, realm) = (heads.clone(), counter.clone(), realm.clone());
            std::thread::spawn(move || {
                let mut conn = conn;
                let Some(text) = read_head(&mut conn) else {
                    return;
                };
                heads.lock().unwrap().push(text.clone());
                let line = text.lines().next().unwrap_or("").to_owned();
                if line.starts_with("GET /token?") {
                    match answer {
                        TokenAnswer::Granted => {
                            let body = br#"{"token":"granted-token","expires_in":300}"#;
                            let _ = conn.write_all(
                                format!(
                                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                                    body.len()
                                )
                                .as_bytes(),
                            );
                            let _ = conn.write_all(body);
                        }
                        TokenAnswer::Endless => {
                            send_endless(&mut conn, "application/json", &counter);
                        }
                    }
                    return;
                }
                let signed = text
                    .lines()
                    .any(|l| l.eq_ignore_ascii_case("authorization: bearer granted-token"));
                if line.starts_with("GET /v2/ ") || !signed {
                    let _ = conn.write_all(
                        format!(
                            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"http://{realm}/token\",service=\"test \\\"front\\\"\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        )
                        .as_bytes(),
                    );
                    return;
                }
                // Passed on as it came, but for the connection, which ends with the answer.
                let Ok(mut upstream) = TcpStream::connect(("127.0.0.1", registry_port)) else {
                    return;
                };
                let passed: String = text
                    .split_inclusive("\r\n")
                    .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
                    .collect::<String>()
                    .replacen("\r\n", "\r\nConnection: close\r\n", 1);
                let _ = upstream.write_all(passed.as_bytes());
                let _ = std::io::copy(&mut upstream, &mut conn);
            });
        }
    });
    (address, seen, sent)
}

/// A registry behind a token service: the pull signs in at the challenge's realm with the
/// login, for the repository's pull scope, and sends the token with every manifest and blob
/// request. A realm that answers without end is cut off at the size a token answer may be.
#[test]
fn a_registry_behind_a_token_service_is_pulled_with_its_token_and_an_endless_answer_is_cut_off() {
    let dir = tempdir();
    let registry = Registry::start(dir.path());
    let state = dir.path().join("state");
    let pushed = registry.push_image(
        "team/tool",
        &[shell_layer(b"behind a token\n")],
        host_arch(),
    );
    let index = json!({ "schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [pushed] });
    registry.push_manifest("team/tool", "2", OCI_INDEX, &index);

    let (front, seen, _) = bearer_front(registry.port, TokenAnswer::Granted);
    let reference = format!("{front}/team/tool:2");
    let pulled = pull_from(&state, &front)
        .arg("--json")
        .arg(&reference)
        .env("WARDEN_REGISTRY_USER", "ci")
        .env("WARDEN_REGISTRY_PASSWORD", "s3cret")
        .output()
        .unwrap();
    assert!(
        pulled.status.success(),
        "{}{}",
        String::from_utf8_lossy(&pulled.stdout),
        String::from_utf8_lossy(&pulled.stderr)
    );
    let heads = seen.lock().unwrap().clone();
    let token_asks: Vec<&String> = heads
        .iter()
        .filter(|h| h.starts_with("GET /token?"))
        .collect();
    assert_eq!(token_asks.len(), 1, "one sign-in: {heads:?}");
    let ask = token_asks[0];
    assert!(
        ask.contains("scope=repository%3Ateam%2Ftool%3Apull")
            && ask.contains("service=test+%22front%22"),
        "{ask}"
    );
    // The login goes to the realm, as HTTP Basic (ci:s3cret).
    assert!(
        ask.lines()
            .any(|l| l.eq_ignore_ascii_case("authorization: basic Y2k6czNjcmV0")),
        "{ask}"
    );
    // Manifest, configuration and layer, each with the token.
    let fetches: Vec<&String> = heads
        .iter()
        .filter(|h| h.starts_with("GET /v2/team/tool/"))
        .collect();
    assert!(fetches.len() >= 3, "{heads:?}");
    assert!(
        fetches.iter().all(|h| h.contains("granted-token")),
        "a request without the token: {fetches:?}"
    );
    let ran = run_in_image(
        &state,
        dir.path(),
        &reference,
        "while read -r l; do echo \"$l\"; done < /etc/note",
    );
    assert_eq!(
        String::from_utf8_lossy(&ran.stdout),
        "behind a token\n",
        "{ran:?}"
    );

    // A realm that never stops answering.
    let (front, _, sent) = bearer_front(registry.port, TokenAnswer::Endless);
    let started = Instant::now();
    let refused = pull_from(&state, &front)
        .arg(format!("{front}/team/tool:2"))
        .output()
        .unwrap();
    assert_cut_off(
        &refused,
        started,
        &sent,
        &state,
        &["signing in", "more than the 65536 bytes"],
    );
}
