//! Images built here, byte by byte, as OCI layouts, their tars and `docker save` archives: a
//! good one unpacked as overlayfs stacks it, and hostile ones refused with nothing written
//! outside the store.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write as _;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use serde_json::json;
use sha2::Digest as _;

use super::*;

/// One entry of a layer, written with raw header fields (so that hostile names get through).
enum E<'a> {
    Dir(&'a str, u32),
    File(&'a str, u32, &'a [u8]),
    Link(&'a str, &'a str),
    Hard(&'a str, &'a str),
    Char(&'a str, u32, u32),
    Sparse(&'a str, u64),
}

fn header(path: &str, kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    let name = &mut h.as_gnu_mut().unwrap().name;
    name[..path.len()].copy_from_slice(path.as_bytes());
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h
}

fn layer(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for entry in entries {
        let (mut h, data): (tar::Header, &[u8]) = match entry {
            E::Dir(p, m) => (header(p, tar::EntryType::Directory, *m, 0), b""),
            E::File(p, m, d) => (header(p, tar::EntryType::Regular, *m, d.len() as u64), d),
            E::Link(p, t) | E::Hard(p, t) => {
                let kind = match entry {
                    E::Link(..) => tar::EntryType::Symlink,
                    _ => tar::EntryType::Link,
                };
                let mut h = header(p, kind, 0o777, 0);
                let link = &mut h.as_gnu_mut().unwrap().linkname;
                link[..t.len()].copy_from_slice(t.as_bytes());
                (h, b"")
            }
            E::Char(p, major, minor) => {
                let mut h = header(p, tar::EntryType::Char, 0o666, 0);
                h.set_device_major(*major).unwrap();
                h.set_device_minor(*minor).unwrap();
                (h, b"")
            }
            E::Sparse(p, size) => {
                // One byte stored at the very end of a huge file.
                let mut h = header(p, tar::EntryType::GNUSparse, 0o644, 1);
                let gnu = h.as_gnu_mut().unwrap();
                gnu.set_real_size(*size);
                gnu.sparse[0].set_offset(*size - 1);
                gnu.sparse[0].set_length(1);
                (h, b"A")
            }
        };
        h.set_cksum();
        b.append(&h, data).unwrap();
    }
    b.into_inner().unwrap()
}

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

fn put_blob(dir: &Path, bytes: &[u8]) -> String {
    let digest = sha(bytes);
    let path = dir.join("blobs/sha256").join(&digest[7..]);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
    digest
}

/// An OCI layout in `dir` with these layers (gzipped), and the digests of its layer blobs.
fn oci_layout(dir: &Path, layers: &[Vec<u8>], name: &str) -> Vec<String> {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let mut descriptors = Vec::new();
    let mut blobs = Vec::new();
    for layer in layers {
        let gz = gzip(layer);
        let digest = put_blob(dir, &gz);
        blobs.push(digest.clone());
        descriptors.push(json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": digest, "size": gz.len(),
        }));
    }
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": { "Env": ["PATH=/usr/bin:/bin", "GREETING=from-the-image"], "WorkingDir": "/srv", "User": "1000", "Cmd": ["sh"] },
        "rootfs": { "type": "layers", "diff_ids": layers.iter().map(|l| sha(l)).collect::<Vec<_>>() },
    })
    .to_string();
    let config_digest = put_blob(dir, config.as_bytes());
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len() },
        "layers": descriptors,
    })
    .to_string();
    let manifest_digest = put_blob(dir, manifest.as_bytes());
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": manifest.len(),
            "annotations": { "org.opencontainers.image.ref.name": name },
        }],
    });
    std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
    blobs
}

/// A tar of the tree `dir` (what `docker save` or `skopeo` hands over).
fn tar_of(dir: &Path, out: &Path) {
    let mut b = tar::Builder::new(std::fs::File::create(out).unwrap());
    b.append_dir_all(".", dir).unwrap();
    b.finish().unwrap();
}

struct Setup {
    _tmp: tempfile::TempDir,
    base: PathBuf,
    store: Store,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().to_path_buf();
    std::fs::create_dir_all(base.join("outside")).unwrap();
    let store = Store::new(&base.join("state"));
    Setup {
        _tmp: tmp,
        base,
        store,
    }
}

fn good_layers() -> Vec<Vec<u8>> {
    vec![
        layer(&[
            E::Dir("etc/", 0o755),
            E::File("etc/hello", 0o644, b"hello from layer one\n"),
            E::Hard("etc/hello2", "etc/hello"),
            E::File("bin/tool", 0o4755, b"#!/bin/sh\necho tool\n"),
            E::Link("lib", "usr/lib"),
            E::Dir("usr/lib/", 0o755),
            E::File("usr/lib/old", 0o644, b"old"),
            E::Dir("srv/", 0o555),
        ]),
        layer(&[
            E::File("etc/.wh.hello2", 0o644, b""),
            E::File("usr/lib/.wh..wh..opq", 0o644, b""),
            E::File("usr/lib/new", 0o644, b"new"),
            E::File("etc/hello", 0o600, b"hello from layer two\n"),
        ]),
    ]
}

#[test]
fn a_layout_is_unpacked_as_overlayfs_stacks_it() {
    let s = setup();
    let layout = s.base.join("layout");
    oci_layout(&layout, &good_layers(), "tools:1");
    let image = s.store.import(&layout, None).unwrap();
    assert_eq!(image.name, "tools:1");
    assert_eq!(image.env, ["PATH=/usr/bin:/bin", "GREETING=from-the-image"]);
    assert_eq!(image.workdir.as_deref(), Some("/srv"));
    assert_eq!(image.user.as_deref(), Some("1000"));
    assert_eq!(image.cmd, ["sh"]);
    let (_, dirs) = s.store.lower_dirs("tools:1").unwrap();
    assert_eq!(dirs.len(), 2);
    let (top, bottom) = (&dirs[0], &dirs[1]);
    // Bottom layer: files, the hard link (one inode), the symlink as text, set-id dropped.
    assert_eq!(
        std::fs::read_to_string(bottom.join("etc/hello")).unwrap(),
        "hello from layer one\n"
    );
    let (a, b) = (
        std::fs::metadata(bottom.join("etc/hello")).unwrap(),
        std::fs::metadata(bottom.join("etc/hello2")).unwrap(),
    );
    assert_eq!(a.ino(), b.ino());
    assert_eq!(
        std::fs::read_link(bottom.join("lib")).unwrap(),
        Path::new("usr/lib")
    );
    assert_eq!(
        std::fs::metadata(bottom.join("bin/tool"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777,
        0o755
    );
    // Top layer: the whiteout, the opaque directory, the replaced file's new mode.
    let wh = std::fs::symlink_metadata(top.join("etc/hello2")).unwrap();
    assert!(wh.file_type().is_char_device() && wh.rdev() == 0, "{wh:?}");
    let opaque =
        rustix::fs::getxattr(top.join("usr/lib"), "user.overlay.opaque", &mut [0u8; 4]).unwrap();
    assert_eq!(opaque, 1);
    assert_eq!(
        std::fs::metadata(top.join("etc/hello"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    assert!(!top.join("etc/.wh.hello2").exists());
    // The same image again under its name is refused; under another it shares the layers.
    assert!(matches!(
        s.store.import(&layout, None),
        Err(ImageError::Exists(_))
    ));
    let again = s.store.import(&layout, Some("tools:again")).unwrap();
    assert_eq!(again.layers, image.layers);
    assert_eq!(s.store.list().unwrap().len(), 2);
    // Removing one keeps the shared layers; removing the other removes them.
    s.store.remove("tools:1").unwrap();
    assert!(top.is_dir() && bottom.is_dir());
    s.store.remove("tools:again").unwrap();
    assert!(!top.exists() && !bottom.exists());
    assert!(matches!(
        s.store.get("tools:1"),
        Err(ImageError::NotFound(_))
    ));
}

#[test]
fn an_archive_of_a_layout_and_a_docker_save_archive_import_alike() {
    let s = setup();
    let layout = s.base.join("layout");
    oci_layout(&layout, &good_layers(), "tools:1");
    let archive = s.base.join("tools.tar");
    tar_of(&layout, &archive);
    let from_tar = s.store.import(&archive, Some("from-tar")).unwrap();
    assert_eq!(from_tar.layers.len(), 2);

    // A classic `docker save`: manifest.json, HEX.json, ID/layer.tar (uncompressed), and a
    // second name of a layer as a symlink.
    let docker = s.base.join("docker");
    std::fs::create_dir_all(docker.join("aaa")).unwrap();
    let layers = good_layers();
    std::fs::write(docker.join("aaa/layer.tar"), &layers[0]).unwrap();
    std::fs::create_dir_all(docker.join("bbb")).unwrap();
    std::fs::write(docker.join("bbb/layer.tar"), &layers[1]).unwrap();
    std::fs::create_dir_all(docker.join("ccc")).unwrap();
    std::os::unix::fs::symlink("../aaa/layer.tar", docker.join("ccc/layer.tar")).unwrap();
    let config = json!({
        "architecture": "amd64", "os": "linux", "config": { "Env": ["A=1"] },
        "rootfs": { "type": "layers", "diff_ids": [sha(&layers[0]), sha(&layers[1]), sha(&layers[0])] },
    })
    .to_string();
    let config_name = format!("{}.json", &sha(config.as_bytes())[7..]);
    std::fs::write(docker.join(&config_name), &config).unwrap();
    std::fs::write(
        docker.join("manifest.json"),
        json!([{ "Config": config_name, "RepoTags": ["legacy:2"], "Layers": ["aaa/layer.tar", "bbb/layer.tar", "ccc/layer.tar"] }]).to_string(),
    )
    .unwrap();
    let archive = s.base.join("docker.tar");
    tar_of(&docker, &archive);
    let legacy = s.store.import(&archive, None).unwrap();
    assert_eq!(legacy.name, "legacy:2");
    assert_eq!(legacy.env, ["A=1"]);
    assert_eq!(legacy.layers.len(), 3);
    assert_eq!(legacy.layers[..2], from_tar.layers[..]);
}

/// What a refused import must leave: nothing outside the store, no layer, no staging.
fn assert_nothing_left(s: &Setup) {
    let outside: Vec<_> = std::fs::read_dir(s.base.join("outside")).unwrap().collect();
    assert!(outside.is_empty(), "written outside the store: {outside:?}");
    for dir in ["layers", "staging", "records"] {
        let path = s.store.root().join(dir);
        let left: Vec<_> = std::fs::read_dir(&path)
            .map(|d| d.collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "left in {}: {left:?}", path.display());
    }
}

fn refused(s: &Setup, entries: &[E], expect: &str) {
    refused_layer(s, layer(entries), expect);
}

/// Like `refused`, for a layer made byte by byte.
fn refused_layer(s: &Setup, layer: Vec<u8>, expect: &str) -> String {
    let layout = s.base.join(format!("hostile-{}", expect.len()));
    let _ = std::fs::remove_dir_all(&layout);
    oci_layout(&layout, &[layer], "hostile:1");
    let err = s.store.import(&layout, None).unwrap_err();
    let text = err.to_string();
    assert!(text.contains(expect), "{expect:?} not in: {text}");
    assert_nothing_left(s);
    // As an archive too.
    let archive = s.base.join("hostile.tar");
    tar_of(&layout, &archive);
    let text = s.store.import(&archive, None).unwrap_err().to_string();
    assert!(text.contains(expect), "{expect:?} not in: {text}");
    assert_nothing_left(s);
    text
}

/// A tar of one GNU long name entry of `long` bytes, then a file.
fn long_name_tar(long: &[u8]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = header(
        "././@LongLink",
        tar::EntryType::GNULongName,
        0o644,
        long.len() as u64,
    );
    h.set_cksum();
    b.append(&h, long).unwrap();
    let mut h = header("x", tar::EntryType::Regular, 0o644, 1);
    h.set_cksum();
    b.append(&h, &b"x"[..]).unwrap();
    b.into_inner().unwrap()
}

#[test]
fn a_long_name_past_the_header_limit_is_refused_before_it_is_held_in_memory() {
    // Once held whole by the tar reader: a small gzipped blob made gigabytes of memory.
    let s = setup();
    let long = vec![b'a'; (extract::HEADER_LIMIT + 4096) as usize];
    refused_layer(&s, long_name_tar(&long), "pass 1048576 bytes");
    // The same in the archive around the layout.
    let archive = s.base.join("long.tar");
    std::fs::write(&archive, long_name_tar(&long)).unwrap();
    let text = s.store.import(&archive, None).unwrap_err().to_string();
    assert!(text.contains("pass 1048576 bytes"), "{text}");
    assert_nothing_left(&s);
}

#[test]
fn a_refused_name_is_shown_cut_short() {
    let s = setup();
    let text = refused_layer(&s, long_name_tar(&[b'n'; 300_000]), "refused entry `nnnn");
    assert!(text.len() < 1000, "{} bytes of error", text.len());
    assert!(
        text.contains("(300000 bytes)"),
        "{}",
        &text[..text.len().min(1000)]
    );
}

#[test]
fn a_path_too_deep_to_remove_is_refused() {
    let s = setup();
    let deep = |depth: usize| {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(1);
        b.append_data(&mut h, format!("{}f", "d/".repeat(depth)), &b"x"[..])
            .unwrap();
        b.into_inner().unwrap()
    };
    refused_layer(&s, deep(300), "more than 256 directories deep");
    // As deep as allowed is imported, and removed again.
    let layout = s.base.join("deep");
    oci_layout(&layout, &[deep(256)], "deep:1");
    s.store.import(&layout, None).unwrap();
    s.store.remove("deep:1").unwrap();
    assert_nothing_left(&s);
}

#[test]
fn documents_too_big_and_files_that_are_not_files_are_not_read() {
    let s = setup();
    // A `docker save` manifest.json of 5 MiB (valid JSON: mostly spaces).
    let docker = s.base.join("docker");
    std::fs::create_dir_all(&docker).unwrap();
    let mut manifest = br#"[{"Config":"c.json","Layers":[]}]"#.to_vec();
    manifest.resize(5 << 20, b' ');
    std::fs::write(docker.join("manifest.json"), &manifest).unwrap();
    let text = s.store.import(&docker, None).unwrap_err().to_string();
    assert!(text.contains("larger than 4194304 bytes"), "{text}");
    let archive = s.base.join("docker.tar");
    tar_of(&docker, &archive);
    let text = s.store.import(&archive, None).unwrap_err().to_string();
    assert!(text.contains("larger than 4194304 bytes"), "{text}");
    // Its configuration a FIFO no one writes to: once waited on forever, with the store locked.
    std::fs::write(
        docker.join("manifest.json"),
        br#"[{"Config":"c.json","Layers":[]}]"#,
    )
    .unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        docker.join("c.json"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let text = s.store.import(&docker, None).unwrap_err().to_string();
    assert!(text.contains("not a regular file"), "{text}");
    // A layout whose layer blob is a link to /dev/zero: once read without end.
    let layout = s.base.join("zero");
    let blobs = oci_layout(&layout, &good_layers(), "zero:1");
    let path = layout.join("blobs/sha256").join(&blobs[0][7..]);
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
    let text = s.store.import(&layout, None).unwrap_err().to_string();
    assert!(text.contains("not a regular file"), "{text}");
    assert_nothing_left(&s);
}

#[test]
fn hostile_layers_are_refused_and_write_nothing_outside_the_store() {
    let s = setup();
    let outside = s.base.join("outside");
    let up = |path: &Path| {
        // The relative way from a layer's staging folder to `outside`.
        format!(
            "../../../../{}",
            path.file_name().unwrap().to_str().unwrap()
        )
    };
    refused(&s, &[E::File("/etc/evil", 0o644, b"x")], "an absolute path");
    refused(
        &s,
        &[E::File("../../../outside/evil", 0o644, b"x")],
        "a path with `..`",
    );
    refused(
        &s,
        &[E::File("a/../../evil", 0o644, b"x")],
        "a path with `..`",
    );
    // A symlink, then a file through it.
    refused(
        &s,
        &[
            E::Link("escape", &up(&outside)),
            E::File("escape/pwned", 0o644, b"x"),
        ],
        "goes through escape, which is a symlink",
    );
    refused(
        &s,
        &[
            E::Link("abs", outside.to_str().unwrap()),
            E::File("abs/pwned", 0o644, b"x"),
        ],
        "goes through abs, which is a symlink",
    );
    // Hard links out, by `..`, by an absolute path, and through a symlink.
    refused(
        &s,
        &[E::Hard("h", "../../../../etc/passwd")],
        "a hard link whose target is a path with `..`",
    );
    refused(
        &s,
        &[E::Hard("h", "/etc/passwd")],
        "a hard link whose target is an absolute path",
    );
    refused(
        &s,
        &[E::Link("l", "/etc"), E::Hard("h", "l/passwd")],
        "not a file of this layer",
    );
    refused(&s, &[E::Char("dev/mem", 1, 1)], "a device node (1:1)");
    refused(
        &s,
        &[E::Sparse("big", 1 << 40)],
        "a sparse file of 1099511627776 bytes",
    );
    refused(&s, &[E::File(".wh.", 0o644, b"")], "a whiteout of no name");
}

#[test]
fn a_layer_past_the_limit_is_refused() {
    let s = setup();
    let store = s.store.clone().with_limits(Limits {
        bytes: 1000,
        entries: 100,
    });
    let layout = s.base.join("big");
    oci_layout(
        &layout,
        &[layer(&[
            E::File("a", 0o644, &[7u8; 600]),
            E::File("b", 0o644, &[7u8; 600]),
        ])],
        "big:1",
    );
    let text = store.import(&layout, None).unwrap_err().to_string();
    assert!(
        text.contains("refused entry `b`") && text.contains("1000 bytes"),
        "{text}"
    );
    assert_nothing_left(&s);
}

#[test]
fn digests_that_do_not_match_are_refused() {
    let s = setup();
    // A layer blob changed after the manifest named it.
    let layout = s.base.join("changed");
    let blobs = oci_layout(&layout, &good_layers(), "changed:1");
    let path = layout.join("blobs/sha256").join(&blobs[1][7..]);
    let changed = gzip(&layer(&[E::File("etc/evil", 0o644, b"swapped")]));
    std::fs::write(&path, changed).unwrap();
    let text = s.store.import(&layout, None).unwrap_err().to_string();
    assert!(text.contains("does not match its digest"), "{text}");
    assert!(s.store.list().unwrap().is_empty());
    // A layer whose content is not what the configuration's diff id says (its blob digest
    // fixed up to match): the diff id catches it.
    let layout = s.base.join("diffid");
    let layers = good_layers();
    oci_layout(&layout, &layers, "diffid:1");
    let swapped = layer(&[E::File("etc/evil", 0o644, b"swapped")]);
    let gz = gzip(&swapped);
    let digest = put_blob(&layout, &gz);
    let manifest_path = std::fs::read_dir(layout.join("blobs/sha256"))
        .unwrap()
        .filter_map(Result::ok)
        .find(|e| std::fs::read_to_string(e.path()).is_ok_and(|t| t.contains("\"layers\"")))
        .unwrap()
        .path();
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    manifest["layers"][0]["digest"] = json!(digest);
    manifest["layers"][0]["size"] = json!(gz.len());
    let manifest_bytes = manifest.to_string();
    let manifest_digest = put_blob(&layout, manifest_bytes.as_bytes());
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    index["manifests"][0]["digest"] = json!(manifest_digest);
    index["manifests"][0]["size"] = json!(manifest_bytes.len());
    std::fs::write(layout.join("index.json"), index.to_string()).unwrap();
    let text = s.store.import(&layout, None).unwrap_err().to_string();
    assert!(
        text.contains("layer 1")
            && text.contains("does not match its digest")
            && text.contains(&sha(&layers[0])),
        "{text}"
    );
    assert!(s.store.list().unwrap().is_empty());
    let layers_left: Vec<_> = std::fs::read_dir(s.store.root().join("layers"))
        .unwrap()
        .collect();
    assert!(layers_left.is_empty(), "{layers_left:?}");
}

#[test]
fn bad_names_and_bad_archives_say_what_is_wrong() {
    let s = setup();
    let layout = s.base.join("layout");
    oci_layout(&layout, &good_layers(), "ok:1");
    for name in ["", "../x", "a b", "x;rm", "/abs"] {
        let text = s.store.import(&layout, Some(name)).unwrap_err().to_string();
        assert!(text.contains("is not an image name"), "{name}: {text}");
    }
    let junk = s.base.join("junk.tar");
    std::fs::write(&junk, b"not a tar at all, just words").unwrap();
    let text = s.store.import(&junk, None).unwrap_err().to_string();
    assert!(
        text.contains("neither an OCI image layout") || text.contains("not a tar"),
        "{text}"
    );
    let missing = s
        .store
        .import(&s.base.join("nope.tar"), None)
        .unwrap_err()
        .to_string();
    assert!(missing.contains("nope.tar"), "{missing}");
    assert_nothing_left(&s);
}

#[test]
fn what_killed_pulls_and_imports_left_goes_and_a_running_pulls_stays() {
    let s = setup();
    let root = s.store.root().to_path_buf();
    std::fs::create_dir_all(root.join("staging/4242-0/deep")).unwrap();
    std::fs::write(root.join("staging/4242-0/deep/blob"), vec![7u8; 4096]).unwrap();
    // A killed pull's folder (its lock held by no one) and a running one's (held here).
    for id in ["killed-1", "running-2"] {
        std::fs::create_dir_all(root.join(format!(".pull-{id}/blobs/sha256"))).unwrap();
        std::fs::write(root.join(format!(".pull-{id}/blobs/sha256/x")), b"x").unwrap();
    }
    std::fs::write(root.join(".pull-killed-1.lock"), b"").unwrap();
    let running = std::fs::File::create(root.join(".pull-running-2.lock")).unwrap();
    rustix::fs::flock(&running, rustix::fs::FlockOperation::LockExclusive).unwrap();

    crate::pull::sweep_killed_pulls(&root);
    assert!(!root.join(".pull-killed-1").exists());
    assert!(!root.join(".pull-killed-1.lock").exists());
    assert!(root.join(".pull-running-2/blobs/sha256/x").exists());

    // An import (under the store's lock, so no other runs) clears `staging/` first.
    let dir = s.base.join("layout");
    oci_layout(&dir, &good_layers(), "demo:1");
    s.store.import(&dir, Some("demo")).unwrap();
    assert_eq!(
        std::fs::read_dir(root.join("staging")).unwrap().count(),
        0,
        "a killed import's staging folder stayed"
    );
}
