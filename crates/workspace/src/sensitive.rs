//! Paths whose change deserves a human's explicit choice: files the host later executes or
//! trusts, links that point outside the workspace, files that become executable, entries that
//! become writable by every user.

use std::path::{Component, Path};

use crate::change::{ChangeKind, EntryKind};

/// Which changed paths are sensitive.
#[derive(Debug, Clone, Default)]
pub struct Sensitivity {
    /// Paths relative to the workspace root; a change at or below one is sensitive.
    pub protected: Vec<String>,
}

impl Sensitivity {
    pub fn new(protected: Vec<String>) -> Self {
        Self { protected }
    }

    /// Why a change at `path` is sensitive, if it is. A protected name stands for the whole
    /// class of names its tool reads in its place (`Makefile` for `makefile` and `GNUmakefile`,
    /// which make prefers), so that a new file of another name cannot take over quietly.
    pub fn of_path(&self, path: &str) -> Option<String> {
        let candidate = Path::new(path);
        self.protected.iter().find_map(|p| {
            let protected = Path::new(p);
            if candidate.starts_with(protected) {
                return Some(format!("under `{p}`, which the host executes or trusts"));
            }
            let (parent, name) = (protected.parent()?, protected.file_name()?.to_str()?);
            let class = ALIASES.iter().find(|class| class.contains(&name))?;
            class.iter().find_map(|alias| {
                candidate
                    .starts_with(parent.join(alias))
                    .then(|| format!("`{alias}` is read in place of the protected `{p}`"))
            })
        })
    }

    /// Why removing the host's entry at `path` is sensitive, if it is: a protected path lies
    /// below it, and goes with it (`rm -r sub` in the cell takes a protected `sub/Makefile`
    /// along, which `of_path` of `sub` alone does not see).
    pub fn of_removal(&self, path: &str) -> Option<String> {
        let removed = Path::new(path);
        self.protected.iter().find_map(|p| {
            let protected = Path::new(p);
            (protected != removed && protected.starts_with(removed))
                .then(|| format!("removes `{p}`, which the host executes or trusts"))
        })
    }
}

/// Names a tool reads in place of one another, in the order it looks for them.
const ALIASES: &[&[&str]] = &[
    &["GNUmakefile", "makefile", "Makefile"],
    &["justfile", "Justfile", ".justfile"],
    &[
        "Taskfile.yml",
        "Taskfile.yaml",
        "taskfile.yml",
        "taskfile.yaml",
    ],
    &[".envrc", ".env"],
];

/// Why a symlink target is sensitive: it leads outside the workspace.
/// Why a change that leaves a file or directory writable by every user of the host (and was
/// not so there) needs naming: the mode, which a listing shows only where it changed.
pub fn of_mode(
    kind: ChangeKind,
    entry: EntryKind,
    old_mode: Option<u32>,
    new_mode: Option<u32>,
) -> Option<String> {
    if kind == ChangeKind::Deleted || !matches!(entry, EntryKind::File | EntryKind::Dir) {
        return None;
    }
    let new = new_mode?;
    let others_write = |mode: u32| mode & 0o002 != 0;
    (others_write(new) && !old_mode.is_some_and(others_write))
        .then(|| format!("mode {:o}: writable by every user of the host", new & 0o777))
}

pub fn of_link(path: &str, target: &Path) -> Option<String> {
    if target.is_absolute() {
        return Some("symlink to an absolute path outside the workspace".to_owned());
    }
    // Resolve `..` lexically against the link's own directory.
    let mut depth: i64 = Path::new(path).components().count() as i64 - 1;
    for component in target.components() {
        match component {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            _ => {}
        }
        if depth < 0 {
            return Some("symlink that leads outside the workspace".to_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protected_prefixes_match_whole_components() {
        let s = Sensitivity::new(vec![".git".into(), ".envrc".into()]);
        assert!(s.of_path(".git/hooks/pre-commit").is_some());
        assert!(s.of_path(".envrc").is_some());
        assert!(s.of_path(".github/x").is_none());
        assert!(s.of_path("src/.git").is_none());
    }

    #[test]
    fn removing_a_directory_that_holds_a_protected_path_is_sensitive() {
        let s = Sensitivity::new(vec!["ci/deploy.sh".into(), ".git".into()]);
        assert!(s.of_removal("ci").is_some());
        assert!(s.of_removal("ci/deploy.sh").is_none(), "of_path's to tell");
        assert!(s.of_removal("cix").is_none());
        assert!(s.of_removal("c").is_none());
        assert!(s.of_removal("src").is_none());
    }

    #[test]
    fn a_protected_name_covers_the_names_its_tool_prefers() {
        let s = Sensitivity::new(vec!["Makefile".into(), "sub/Justfile".into()]);
        assert!(s.of_path("Makefile").is_some());
        assert!(s.of_path("GNUmakefile").is_some());
        assert!(s.of_path("makefile").is_some());
        assert!(s.of_path("sub/justfile").is_some());
        assert!(s.of_path("other/makefile").is_none());
        assert!(s.of_path("Makefile.am").is_none());
    }

    #[test]
    fn links_leaving_the_workspace_are_sensitive() {
        assert!(of_link("a", Path::new("/etc/passwd")).is_some());
        assert!(of_link("a", Path::new("../x")).is_some());
        assert!(of_link("d/a", Path::new("../x")).is_none());
        assert!(of_link("d/a", Path::new("../../x")).is_some());
        assert!(of_link("a", Path::new("b/c")).is_none());
    }
}
