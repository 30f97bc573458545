//! What an image's configuration sets for the cells made from it, beside its environment: the
//! user (`User`: `name`, `uid`, `name:group`, `uid:gid`, ...) and the working directory
//! (`WorkingDir`). A name is looked up in the image's own `/etc/passwd` and `/etc/group`, read
//! from its topmost layer that has them, never following a link (a layer's `etc` may point
//! anywhere on the host).

use std::io::Read as _;
use std::path::PathBuf;

use rustix::fs::{Mode, OFlags, ResolveFlags};

use crate::{Image, ImageError};

/// The user and directory an image gives a cell where its policy names none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Defaults {
    /// Its user and group ids; none where the image names no user.
    pub user: Option<(u32, u32)>,
    /// Its working directory; none where the image names none (or `/`, the default of every
    /// image, which a cell does not take over its workspace).
    pub workdir: Option<PathBuf>,
}

/// The most of `/etc/passwd` or `/etc/group` that is read.
const MAX_TABLE: u64 = 4 << 20;

impl Image {
    /// This image's defaults, its user's names resolved in its layers (`lowers`: topmost
    /// first, as [`crate::Store::lower_dirs`] gives them).
    pub fn defaults(&self, lowers: &[PathBuf]) -> Result<Defaults, ImageError> {
        let workdir = match self.workdir.as_deref().map(str::trim) {
            None | Some("" | "/") => None,
            Some(dir) if dir.starts_with('/') && !dir.split('/').any(|c| c == "..") => {
                Some(PathBuf::from(dir))
            }
            Some(dir) => {
                return Err(ImageError::Format(format!(
                    "image {}: its working directory `{dir}` is not an absolute path; set process.cwd in the policy",
                    self.name
                )));
            }
        };
        let user = match self.user.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(spec) => Some(resolve_user(&self.name, spec, lowers)?),
        };
        Ok(Defaults { user, workdir })
    }
}

/// `user[:group]`, each a name or a number, as ids.
fn resolve_user(image: &str, spec: &str, lowers: &[PathBuf]) -> Result<(u32, u32), ImageError> {
    let (user, group) = match spec.split_once(':') {
        Some((user, group)) => (user, Some(group)),
        None => (spec, None),
    };
    let unknown = |what: &str, name: &str, table: &str| {
        ImageError::Format(format!(
            "image {image}: its user `{spec}` names the {what} `{name}`, which its /etc/{table} does not have; set process.user (and process.group) in the policy"
        ))
    };
    let passwd = || read_table(image, lowers, "passwd");
    let (uid, primary) = match user.parse::<u32>() {
        Ok(uid) => {
            // A number need not be in passwd; its group is then its own id.
            let primary = passwd()?
                .as_deref()
                .and_then(|text| find(text, |f| f.get(2) == Some(&user)))
                .and_then(|f| f.get(3)?.parse().ok());
            (uid, primary)
        }
        Err(_) => {
            let text = passwd()?.ok_or_else(|| unknown("user", user, "passwd"))?;
            let fields = find(&text, |f| f.first() == Some(&user))
                .ok_or_else(|| unknown("user", user, "passwd"))?;
            let number = |i: usize| fields.get(i).and_then(|v| v.parse::<u32>().ok());
            let uid = number(2).ok_or_else(|| unknown("user", user, "passwd"))?;
            (uid, number(3))
        }
    };
    let gid = match group {
        None | Some("") => primary.unwrap_or(uid),
        Some(group) => match group.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => {
                let text = read_table(image, lowers, "group")?
                    .ok_or_else(|| unknown("group", group, "group"))?;
                find(&text, |f| f.first() == Some(&group))
                    .and_then(|f| f.get(2)?.parse().ok())
                    .ok_or_else(|| unknown("group", group, "group"))?
            }
        },
    };
    Ok((uid, gid))
}

/// The fields of the first line of a colon-separated table that `matches`.
fn find(text: &str, matches: impl Fn(&[&str]) -> bool) -> Option<Vec<&str>> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| matches(fields))
}

/// `/etc/NAME` as the cell would see it: from the topmost layer that has it; none where no
/// layer has it or the topmost that names it removed it (a whiteout) or hides the layers
/// below (an opaque `etc`).
fn read_table(image: &str, lowers: &[PathBuf], name: &str) -> Result<Option<String>, ImageError> {
    let path = format!("etc/{name}");
    for layer in lowers {
        let dir = rustix::fs::open(
            layer,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| ImageError::io("opening the layer", layer, e.into()))?;
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match rustix::fs::openat2(
            &dir,
            path.as_str(),
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
            resolve,
        ) {
            Ok(fd) => {
                let file = std::fs::File::from(fd);
                let meta = file
                    .metadata()
                    .map_err(|e| ImageError::io("reading", &layer.join(&path), e))?;
                if !meta.is_file() {
                    // A whiteout (a character device) or anything but a file: not there.
                    return Ok(None);
                }
                let mut text = String::new();
                file.take(MAX_TABLE)
                    .read_to_string(&mut text)
                    .map_err(|e| ImageError::io("reading", &layer.join(&path), e))?;
                return Ok(Some(text));
            }
            Err(rustix::io::Errno::NOENT) => {
                if opaque_etc(&dir) {
                    return Ok(None);
                }
            }
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::XDEV) => {
                return Err(ImageError::Format(format!(
                    "image {image}: its /etc/{name} is reached through a link, which is not read; set process.user (and process.group) in the policy"
                )));
            }
            Err(e) => {
                return Err(ImageError::io("reading", &layer.join(&path), e.into()));
            }
        }
    }
    Ok(None)
}

/// Whether the layer's `etc` hides the layers below (marked opaque when unpacked).
fn opaque_etc(layer: &impl rustix::fd::AsFd) -> bool {
    let Ok(etc) = rustix::fs::openat2(
        layer,
        "etc",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS,
    ) else {
        return false;
    };
    let mut value = [0u8; 1];
    rustix::fs::fgetxattr(&etc, "user.overlay.opaque", &mut value)
        .is_ok_and(|n| n == 1 && value[0] == b'y')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn image(user: Option<&str>, workdir: Option<&str>) -> Image {
        Image {
            name: "t".to_owned(),
            digest: String::new(),
            layers: Vec::new(),
            env: Vec::new(),
            workdir: workdir.map(str::to_owned),
            user: user.map(str::to_owned),
            entrypoint: Vec::new(),
            cmd: Vec::new(),
            size: 0,
            imported_ms: 0,
        }
    }

    fn layer(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    #[test]
    fn names_and_numbers_resolve_in_the_topmost_layer_that_has_the_tables() {
        let lower = layer(&[("etc/passwd", "app:x:5000:5000::/home/app:/bin/sh\n")]);
        let upper = layer(&[
            (
                "etc/passwd",
                "root:x:0:0::/root:/bin/sh\nsvc:x:1234:4321::/srv:/bin/sh\n",
            ),
            ("etc/group", "root:x:0:\nstaff:x:50:\n"),
        ]);
        let lowers = vec![upper.path().to_path_buf(), lower.path().to_path_buf()];
        let ids = |spec: &str| image(Some(spec), None).defaults(&lowers).map(|d| d.user);
        assert_eq!(ids("svc").unwrap(), Some((1234, 4321)));
        assert_eq!(ids("svc:staff").unwrap(), Some((1234, 50)));
        assert_eq!(ids("1234").unwrap(), Some((1234, 4321)));
        assert_eq!(ids("777").unwrap(), Some((777, 777)));
        assert_eq!(ids("777:88").unwrap(), Some((777, 88)));
        // The upper layer's passwd hides the lower one's.
        let err = ids("app").unwrap_err().to_string();
        assert!(
            err.contains("`app`") && err.contains("process.user"),
            "{err}"
        );
        let err = ids("svc:nogroup").unwrap_err().to_string();
        assert!(err.contains("`nogroup`"), "{err}");
        assert_eq!(
            image(None, None).defaults(&lowers).unwrap(),
            Defaults::default()
        );
    }

    #[test]
    fn a_working_directory_is_taken_when_absolute_and_not_the_root() {
        let none: Vec<PathBuf> = Vec::new();
        let dir = |w: &str| image(None, Some(w)).defaults(&none).map(|d| d.workdir);
        assert_eq!(dir("/srv/app").unwrap(), Some(PathBuf::from("/srv/app")));
        assert_eq!(dir("/").unwrap(), None);
        assert!(dir("srv").is_err());
        assert!(dir("/srv/../etc").is_err());
    }

    #[test]
    fn a_table_behind_a_link_is_refused_not_followed() {
        let host = layer(&[("passwd", "evil:x:0:0::/:/bin/sh\n")]);
        let top = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(host.path(), top.path().join("etc")).unwrap();
        let lowers = vec![top.path().to_path_buf()];
        let err = image(Some("evil"), None)
            .defaults(&lowers)
            .unwrap_err()
            .to_string();
        assert!(err.contains("through a link"), "{err}");
        // A whiteout of passwd in the top layer hides the one below.
        let below = layer(&[("etc/passwd", "app:x:5000:5000::/:/bin/sh\n")]);
        let above = tempfile::tempdir().unwrap();
        std::fs::create_dir(above.path().join("etc")).unwrap();
        std::os::unix::net::UnixListener::bind(above.path().join("etc/passwd")).unwrap();
        let lowers = vec![above.path().to_path_buf(), below.path().to_path_buf()];
        assert!(image(Some("app"), None).defaults(&lowers).is_err());
    }
}
