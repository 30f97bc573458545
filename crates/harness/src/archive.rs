//! Checks an archive before it is unpacked into a cell, so that one that is refused changes
//! nothing. The cell's file service unpacks member after member and stops at the first it
//! refuses: what came before would stay written. Everything the archive alone decides is
//! checked here first, with the words the file service would use: each member's name (UTF-8,
//! no `..`), its type (files, directories, symlinks and hard links only), a symlink's or a
//! hard link's target where one is needed, and the shape the members make together (nothing
//! under a symlink or a file the same archive makes, no path that is both a directory and not
//! one). What depends on the cell's files as they are (a symlink already there that leads out,
//! a read-only directory, a full disk) is only known where the members are written.

use std::collections::BTreeMap;

/// What a member makes, as far as the members under it care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Made {
    Directory,
    File,
    Symlink,
}

impl Made {
    fn name(self) -> &'static str {
        match self {
            Made::Directory => "a directory",
            Made::File => "a file",
            Made::Symlink => "a symlink",
        }
    }
}

/// Checks every member of `archive` (a tar stream); the refusal names the member.
pub(crate) fn check(archive: &[u8]) -> Result<(), String> {
    let mut made: BTreeMap<String, Made> = BTreeMap::new();
    // Hard links, by member, with the member they link to.
    let mut hard_links: Vec<(String, String)> = Vec::new();
    // Hard links to a name the archive had not made when they came (a file of the cell's, or
    // one the archive makes later, which the unpacker could not link to yet).
    let mut later: Vec<(String, String)> = Vec::new();
    let mut tar = tar::Archive::new(archive);
    let entries = tar
        .entries()
        .map_err(|e| format!("reading the archive: {e}"))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("reading the archive: {e}"))?;
        let raw = entry.path_bytes().into_owned();
        let member = String::from_utf8(raw).map_err(|e| {
            format!(
                "the archive member `{}`'s name is not UTF-8; refused",
                String::from_utf8_lossy(e.as_bytes())
            )
        })?;
        // A leading `/` is stripped where the member is unpacked.
        let member = member.trim_start_matches('/');
        if member.contains('\0') {
            return Err(format!(
                "the archive member `{member}`'s name holds a NUL byte; refused"
            ));
        }
        if member.split('/').any(|part| part == "..") {
            return Err(format!(
                "the archive member `{member}` climbs out with `..`; refused"
            ));
        }
        let path = normal(member);
        if path.is_empty() {
            continue; // `./`: the directory unpacked into
        }
        let kind = match entry.header().entry_type() {
            tar::EntryType::Directory => Made::Directory,
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                Made::File
            }
            tar::EntryType::Symlink => {
                if entry.link_name_bytes().is_none() {
                    return Err(format!("the symlink {member} has no target; refused"));
                }
                Made::Symlink
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| String::from_utf8_lossy(&t).into_owned())
                    .ok_or_else(|| format!("the hard link {member} has no target; refused"))?;
                let target = target.trim_start_matches('/');
                if target.split('/').any(|part| part == "..") {
                    return Err(format!(
                        "the hard link {member} climbs out with `..`; refused"
                    ));
                }
                let target = normal(target);
                // What the unpacker can make: a second name of a file made before it (or of
                // one in the cell already), under a name not made yet (it does not replace).
                if target == path {
                    return Err(format!("the hard link {member} links to itself; refused"));
                }
                if let Some(kind) = made.get(&target).filter(|k| **k != Made::File) {
                    return Err(format!(
                        "the hard link {member} links to `{target}`, which the same archive makes {}: only a file can have a second name; refused",
                        kind.name()
                    ));
                }
                if made.contains_key(&path) {
                    return Err(format!(
                        "the hard link {member} names `{path}`, which the archive made already; refused"
                    ));
                }
                if !made.contains_key(&target) {
                    later.push((member.to_owned(), target.clone()));
                }
                hard_links.push((path.clone(), target));
                Made::File
            }
            other => {
                return Err(format!(
                    "the archive member {member} is a {other:?}; only files, directories and links are unpacked"
                ));
            }
        };
        // A later file or symlink replaces an earlier one; a directory is never replaced.
        if let Some(before) = made.insert(path.clone(), kind)
            && before != kind
            && (before == Made::Directory || kind == Made::Directory)
        {
            return Err(format!(
                "the archive member `{member}` is both {} and {}; refused",
                before.name(),
                kind.name()
            ));
        }
    }
    // Nothing is written through, or below, what the archive makes other than a directory: a
    // symlink's target is the cell's to decide, and may lead out of its files.
    let under = |path: &str| -> Option<(String, Made)> {
        let mut ancestor = String::new();
        let mut parts = path.split('/').peekable();
        while let Some(part) = parts.next() {
            parts.peek()?;
            if !ancestor.is_empty() {
                ancestor.push('/');
            }
            ancestor.push_str(part);
            match made.get(&ancestor) {
                Some(Made::Directory) | None => {}
                Some(kind) => return Some((ancestor, *kind)),
            }
        }
        None
    };
    for path in made.keys() {
        if let Some((ancestor, kind)) = under(path) {
            return Err(format!(
                "the archive member `{path}` lies under `{ancestor}`, which the same archive makes {}; refused",
                kind.name()
            ));
        }
    }
    if let Some((member, target)) = later.iter().find(|(_, t)| made.contains_key(t)) {
        return Err(format!(
            "the hard link {member} links to `{target}`, which comes later in the archive; refused"
        ));
    }
    for (path, target) in &hard_links {
        if let Some((ancestor, kind)) = under(target) {
            return Err(format!(
                "the hard link {path} links to `{target}`, under `{ancestor}`, which the same archive makes {}; refused",
                kind.name()
            ));
        }
    }
    Ok(())
}

/// A member's path as it is unpacked: no empty or `.` parts.
fn normal(path: &str) -> String {
    path.split('/')
        .filter(|part| !part.is_empty() && *part != ".")
        .collect::<Vec<_>>()
        .join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    enum Member<'a> {
        Dir(&'a str),
        File(&'a str),
        Symlink(&'a str, &'a str),
        HardLink(&'a str, &'a str),
        Fifo(&'a str),
    }

    /// An archive of `members`, their names written as they are (`..` included).
    fn archive(members: &[Member]) -> Vec<u8> {
        let mut out = tar::Builder::new(Vec::new());
        for member in members {
            let mut header = tar::Header::new_gnu();
            let (name, kind, link) = match member {
                Member::Dir(n) => (*n, tar::EntryType::Directory, None),
                Member::File(n) => (*n, tar::EntryType::Regular, None),
                Member::Symlink(n, t) => (*n, tar::EntryType::Symlink, Some(*t)),
                Member::HardLink(n, t) => (*n, tar::EntryType::Link, Some(*t)),
                Member::Fifo(n) => (*n, tar::EntryType::Fifo, None),
            };
            let name_field = &mut header.as_old_mut().name;
            name_field[..name.len()].copy_from_slice(name.as_bytes());
            if let Some(link) = link {
                let link_field = &mut header.as_old_mut().linkname;
                link_field[..link.len()].copy_from_slice(link.as_bytes());
            }
            header.set_entry_type(kind);
            header.set_mode(0o644);
            let data: &[u8] = if matches!(member, Member::File(_)) {
                b"data\n"
            } else {
                b""
            };
            header.set_size(data.len() as u64);
            header.set_cksum();
            out.append(&header, data).unwrap();
        }
        out.into_inner().unwrap()
    }

    #[test]
    fn an_archive_of_files_directories_and_links_inside_passes() {
        let ok = archive(&[
            Member::Dir("./"),
            Member::Dir("./sub/"),
            Member::File("./sub/a.txt"),
            Member::File("/b.txt"),
            Member::Symlink("./out", "/somewhere/outside"),
            Member::Symlink("./out", "sub"),
            Member::HardLink("./c.txt", "sub/a.txt"),
            Member::File("sub/a.txt"),
        ]);
        assert_eq!(check(&ok), Ok(()));
    }

    #[test]
    fn a_member_written_through_a_symlink_of_the_same_archive_is_refused() {
        let through = archive(&[
            Member::File("ok.txt"),
            Member::Symlink("lnk", "/somewhere/outside"),
            Member::File("lnk/escape.txt"),
        ]);
        let refused = check(&through).unwrap_err();
        assert!(
            refused.contains("`lnk/escape.txt`") && refused.contains("a symlink"),
            "{refused}"
        );
        // Whichever comes first.
        let before = archive(&[
            Member::File("lnk/escape.txt"),
            Member::Symlink("./lnk", "/somewhere/outside"),
        ]);
        assert!(check(&before).unwrap_err().contains("`lnk/escape.txt`"));
        let linked = archive(&[
            Member::Symlink("lnk", "/etc"),
            Member::HardLink("pw", "lnk/passwd"),
        ]);
        assert!(check(&linked).unwrap_err().contains("hard link pw"));
    }

    #[test]
    fn names_types_and_shapes_that_cannot_be_unpacked_are_refused_by_member() {
        let cases: [(&[Member], &str); 10] = [
            (
                &[Member::File("ok.txt"), Member::File("../x")],
                "`../x` climbs out",
            ),
            (&[Member::File("a/../../x")], "`a/../../x` climbs out"),
            (
                &[Member::HardLink("h", "../../etc/passwd")],
                "hard link h climbs out",
            ),
            (&[Member::Fifo("pipe")], "pipe is a Fifo"),
            (
                &[Member::File("f"), Member::File("f/g")],
                "`f/g` lies under `f`",
            ),
            (
                &[Member::Dir("d"), Member::File("d")],
                "`d` is both a directory and a file",
            ),
            // Hard links the unpacker cannot make: to a member that comes later, to itself,
            // to a directory, over a name made already.
            (
                &[
                    Member::File("a.txt"),
                    Member::HardLink("h", "later.txt"),
                    Member::File("later.txt"),
                ],
                "comes later in the archive",
            ),
            (
                &[Member::File("b.txt"), Member::HardLink("b.txt", "b.txt")],
                "links to itself",
            ),
            (
                &[Member::Dir("sub"), Member::HardLink("hl", "sub")],
                "only a file can have a second name",
            ),
            (
                &[
                    Member::File("c.txt"),
                    Member::File("d.txt"),
                    Member::HardLink("d.txt", "c.txt"),
                ],
                "made already",
            ),
        ];
        for (members, says) in cases {
            let refused = check(&archive(members)).unwrap_err();
            assert!(refused.contains(says), "`{refused}` should say `{says}`");
        }
    }
}
