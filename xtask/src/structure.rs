//! The shape of the agent's crate, checked before any test: no file of
//! `governor/src` over [`MAX_LINES`] lines, and no import cycle between its
//! files. A file's imports are the `crate::`, `super::` and `self::` paths
//! it names (in `use` trees and inline), each resolved to the deepest file
//! that defines a prefix of it. A module naming its own descendants
//! (declaring and re-exporting them) is not an import; a descendant naming
//! an ancestor is.

use anyhow::{Result, bail};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The longest a file of `governor/src` may grow.
pub const MAX_LINES: usize = 600;

/// Checks `root` (`governor/src`); the crate's binary root `main.rs` is
/// its own crate and stays out.
pub fn check(root: &Path) -> Result<()> {
    let mut files = BTreeMap::new();
    collect(root, root, &mut files)?;
    let long: Vec<String> = files
        .iter()
        .filter(|(_, text)| text.lines().count() > MAX_LINES)
        .map(|(m, text)| format!("{} ({} lines)", shown(m), text.lines().count()))
        .collect();
    if !long.is_empty() {
        bail!("files of governor/src over {MAX_LINES} lines: {}", long.join(", "));
    }
    let cycles = cycles(&files);
    if !cycles.is_empty() {
        let list: Vec<String> = cycles.iter().map(|c| c.iter().map(shown).collect::<Vec<_>>().join(" <-> ")).collect();
        bail!("import cycles between files of governor/src: {}", list.join("; "));
    }
    Ok(())
}

/// A module's path from the crate root: `region/admission.rs` is
/// `["region", "admission"]`, `region/mod.rs` is `["region"]`.
type Module = Vec<String>;

fn shown(m: &Module) -> String {
    if m.is_empty() { "lib.rs".into() } else { m.join("::") }
}

fn collect(root: &Path, dir: &Path, out: &mut BTreeMap<Module, String>) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(root, &path, out)?;
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") || (dir == root && path.ends_with("main.rs")) {
            continue;
        }
        let rel = path.strip_prefix(root)?.with_extension("");
        let mut module: Module = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
        if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
            module.pop();
        }
        out.insert(module, std::fs::read_to_string(&path)?);
    }
    Ok(())
}

/// Sets of files that import each other, directly or around a loop.
pub fn cycles(files: &BTreeMap<Module, String>) -> Vec<Vec<Module>> {
    let edges: BTreeMap<&Module, BTreeSet<&Module>> =
        files.iter().map(|(m, text)| (m, imports(m, text, files))).collect();
    // Two files are in one cycle when each reaches the other.
    let reach = |from: &Module| -> BTreeSet<&Module> {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&Module> = edges[from].iter().copied().collect();
        while let Some(m) = todo.pop() {
            if seen.insert(m) {
                todo.extend(edges[m].iter().copied());
            }
        }
        seen
    };
    let reached: BTreeMap<&Module, BTreeSet<&Module>> = files.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<Vec<Module>> = Vec::new();
    for m in files.keys() {
        if !reached[m].contains(m) || out.iter().any(|c| c.contains(m)) {
            continue;
        }
        out.push(files.keys().filter(|o| reached[m].contains(o) && reached[o].contains(m)).cloned().collect());
    }
    out
}

/// The files `module` imports.
fn imports<'a>(module: &Module, text: &str, files: &'a BTreeMap<Module, String>) -> BTreeSet<&'a Module> {
    let code: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let mut paths = Vec::new();
    for (i, _) in code.match_indices("use ") {
        if code[..i].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let tree = &code[i + 4..];
        let tree = &tree[..tree.find(';').unwrap_or(tree.len())];
        // Only a use tree (the words "use " in a string are none).
        let balanced = tree.matches('{').count() == tree.matches('}').count();
        if balanced && tree.chars().all(|c| c.is_alphanumeric() || "_:{},* \n".contains(c)) {
            expand("", tree, &mut paths);
        }
    }
    paths.extend(inline_paths(&code));
    let mut out = BTreeSet::new();
    for p in paths {
        let Some(target) = resolve(module, &p) else { continue };
        // The deepest file that defines a prefix of the path.
        let Some(file) =
            (0..=target.len()).rev().find_map(|n| files.get_key_value(&target[..n].to_vec()).map(|(k, _)| k))
        else {
            continue;
        };
        let descendant = file.len() >= module.len() && file[..module.len()] == module[..];
        if !descendant {
            out.insert(file);
        }
    }
    out
}

/// `a::{b, c::{d, e}}` prefixed with `prefix`: every leaf path.
fn expand(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        out.push(format!("{prefix}{tree}"));
        return;
    };
    let head = format!("{prefix}{}", &tree[..open]);
    let body = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let (mut depth, mut start) = (0, 0);
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand(&head, &body[start..i], out);
                start = i + 1;
            }
            _ => {}
        }
    }
    expand(&head, &body[start..], out);
}

/// Paths written in the code itself: `crate::a::b`, `super::c`.
fn inline_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for root in ["crate::", "super::"] {
        for (i, _) in code.match_indices(root) {
            let before = code[..i].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let len =
                code[i..].find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(code.len() - i);
            out.push(code[i..i + len].to_string());
        }
    }
    out
}

/// A path's segments from the crate root, or `None` for another crate's.
fn resolve(module: &Module, path: &str) -> Option<Module> {
    let mut segments = path.split("::").map(str::trim).filter(|s| !s.is_empty());
    let mut at: Module = match segments.next()? {
        "crate" => Vec::new(),
        "self" => module.clone(),
        "super" => module[..module.len().checked_sub(1)?].to_vec(),
        _ => return None,
    };
    for s in segments {
        match s {
            "super" => {
                at.pop();
            }
            "self" | "*" => {}
            s => at.push(s.split_whitespace().next().unwrap_or(s).to_string()),
        }
    }
    Some(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crate_of(files: &[(&str, &str)]) -> BTreeMap<Module, String> {
        files
            .iter()
            .map(|(m, t)| (m.split('/').filter(|s| !s.is_empty()).map(String::from).collect(), t.to_string()))
            .collect()
    }

    #[test]
    fn siblings_that_import_each_other_are_a_cycle() {
        let files = crate_of(&[
            ("", "pub mod measure;"),
            ("measure", "pub mod ebpf; pub mod profile; use profile::Probe;"),
            ("measure/ebpf", "use super::{Error, profile::Probe};"),
            ("measure/profile", "fn f() -> super::ebpf::Side { todo!() }"),
        ]);
        let c = cycles(&files);
        assert_eq!(c.len(), 1, "{c:?}");
        assert_eq!(c[0].iter().map(shown).collect::<Vec<_>>(), ["measure::ebpf", "measure::profile"]);
    }

    #[test]
    fn a_parent_naming_its_children_is_no_cycle() {
        let files = crate_of(&[
            ("", "pub mod measure; use crate::measure::profile::Probe;"),
            ("measure", "pub mod ebpf; pub mod profile; use self::profile::Probe;\nuse crate::tsc;"),
            ("measure/ebpf", "use super::{Error, profile::Probe};\nuse crate::{tsc::Clock};"),
            ("measure/profile", "use crate::measure::Error; // use super::ebpf::Side;"),
            ("tsc", "use keyspace_governor_common::X;"),
        ]);
        assert!(cycles(&files).is_empty(), "{:?}", cycles(&files));
    }

    #[test]
    fn a_loop_through_three_files_is_one_cycle() {
        let files = crate_of(&[
            ("a", "use crate::b::X;"),
            ("b", "fn f() { crate::c::g() }"),
            ("c", "use crate::{d, a::{Y, Z}};"),
            ("d", ""),
        ]);
        let c = cycles(&files);
        assert_eq!(c.len(), 1, "{c:?}");
        assert_eq!(c[0].len(), 3);
    }

    #[test]
    fn the_agent_crate_has_its_shape() {
        check(&crate::root().join("governor/src")).unwrap();
    }
}
