//! The crate's layers, checked from its source: every file's imports point down a layer or
//! stay in their own, and no two files import each other, directly or around a circle.
//!
//! Layers, lowest first (ARCHITECTURE.md): the error type and the generated bindings (`error.rs`,
//! `sys/`), the checked layer (`result/`), the engine (`engine/`), the CUDA half (`cuda/`), the
//! NCCL half (`nccl/`), and on top the article's kernels and the cudarc interop.
//!
//! An import is any `crate::`, `super::` or `self::` path in code (comments are left out), each
//! resolved to the file that defines it, through the `pub use` re-exports of `lib.rs` and the
//! `mod.rs` files, so that an import through a re-export counts as an import of the file that
//! defines the item; a path from a module into its own children (declaring and re-exporting
//! them) is structure, as the shared `rust-import-cycles` counts it. Run it alone with
//! `cargo test --test layers -- --nocapture` to see the import graph, and with
//! `LAYERS_DEBUG=<file under src/>` to see how each path of that file resolves.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Layer of each file, by its path under `src/`; the crate root (`lib.rs`) has none.
fn layer(file: &str) -> Option<(usize, &'static str)> {
    const LAYERS: &[(&str, usize, &str)] = &[
        ("error.rs", 0, "error and bindings"),
        ("trace.rs", 0, "error and bindings"),
        ("sys/", 0, "error and bindings"),
        ("result/", 1, "checked layer"),
        ("engine/", 2, "engine"),
        ("cuda/", 3, "CUDA half"),
        ("nccl/", 4, "NCCL half"),
        ("kernels.rs", 5, "top"),
        ("interop.rs", 5, "top"),
    ];
    LAYERS
        .iter()
        .find(|(p, _, _)| file.starts_with(p))
        .map(|&(_, l, name)| (l, name))
}

type ModPath = Vec<String>;

struct Crate {
    /// Module path to file (relative to `src/`).
    files: BTreeMap<ModPath, String>,
    /// Per module, the names it re-exports (`pub use` / `pub(crate) use`) and their full paths.
    reexports: BTreeMap<ModPath, BTreeMap<String, ModPath>>,
    /// Per module, the paths its code names.
    paths: BTreeMap<ModPath, Vec<ModPath>>,
}

fn strip_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    // Block comments first.
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        rest = rest[i..].find("*/").map_or("", |j| &rest[i + j + 2..]);
    }
    out.push_str(rest);
    out.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `a::{b, c::{d, e}}` into `a::b`, `a::c::d`, `a::c::e`; `x as y` keeps `x` and notes `y`.
fn expand_use(body: &str, out: &mut Vec<(String, String)>) {
    let body = body.trim();
    if let Some(open) = body.find('{') {
        let prefix = &body[..open];
        let Some(close) = body.rfind('}').filter(|&c| c > open) else {
            return;
        };
        let inner = &body[open + 1..close];
        let (mut depth, mut start) = (0, 0);
        for (i, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand_use(&format!("{prefix}{}", inner[start..i].trim()), out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        if !inner[start..].trim().is_empty() {
            expand_use(&format!("{prefix}{}", inner[start..].trim()), out);
        }
        return;
    }
    let (path, alias) = match body.split_once(" as ") {
        Some((p, a)) => (p.trim(), a.trim()),
        None => (body, body.rsplit("::").next().unwrap_or(body)),
    };
    let path = path.trim_end_matches("::self");
    let alias = if alias == "self" {
        path.rsplit("::").next().unwrap_or(path)
    } else {
        alias
    };
    out.push((path.to_string(), alias.to_string()));
}

/// A path as written in module `here`, made absolute.
fn absolute(here: &ModPath, path: &str) -> Option<ModPath> {
    let segs: Vec<&str> = path
        .split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let (mut base, rest) = match segs.first()? {
        &"crate" => (Vec::new(), &segs[1..]),
        &"self" => (here.clone(), &segs[1..]),
        &"super" => {
            let mut b = here.clone();
            let mut r = &segs[..];
            while r.first() == Some(&"super") {
                b.pop();
                r = &r[1..];
            }
            (b, r)
        }
        // A path from a child module (`use inner::Thing` in `mod.rs`); other crates' paths
        // (`std::...`) resolve to the module itself, which is no import.
        first if first.chars().all(is_ident) => (here.clone(), &segs[..]),
        _ => return None,
    };
    base.extend(rest.iter().map(|s| s.to_string()));
    Some(base)
}

/// The inline modules of a file (`mod name { ... }`), as (start, end, name), outermost first.
fn inline_modules(text: &str) -> Vec<(usize, usize, String)> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("mod ") {
        if text[..i].chars().last().is_some_and(is_ident) {
            continue;
        }
        let rest = &text[i + 4..];
        let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
        let after = rest[name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue;
        }
        let open = i + 4 + rest.len() - after.len();
        let mut depth = 0usize;
        for (j, ch) in text[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push((open, open + j, name.clone()));
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl Crate {
    fn read(src: &Path) -> Crate {
        let mut c = Crate {
            files: BTreeMap::new(),
            reexports: BTreeMap::new(),
            paths: BTreeMap::new(),
        };
        let mut stack = vec![src.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).expect("src readable") {
                let p = e.expect("entry").path();
                if p.is_dir() {
                    if p.file_name().is_some_and(|n| n != "generated") {
                        stack.push(p);
                    }
                    continue;
                }
                if p.extension().is_none_or(|x| x != "rs") {
                    continue;
                }
                let rel = p
                    .strip_prefix(src)
                    .expect("under src")
                    .to_string_lossy()
                    .to_string();
                let mut m: ModPath = rel.trim_end_matches(".rs").split('/').map(String::from).collect();
                let dir = matches!(m.last().map(String::as_str), Some("mod" | "lib"));
                if dir {
                    m.pop();
                }
                let text = strip_comments(&std::fs::read_to_string(&p).expect("readable"));
                let inline = inline_modules(&text);
                // The module a position of the file is in: the file's, or an inline one in it
                // (`mod tests { ... }`).
                let within = |i: usize| {
                    let mut here = m.clone();
                    here.extend(
                        inline
                            .iter()
                            .filter(|(a, b, _)| *a < i && i < *b)
                            .map(|(_, _, name)| name.clone()),
                    );
                    here
                };
                let mut uses = Vec::new();
                let mut exports = BTreeMap::new();
                for (i, _) in text.match_indices("use ") {
                    let before = &text[..i];
                    if before.chars().last().is_some_and(is_ident) {
                        continue;
                    }
                    let line_start = before.rfind('\n').map_or(0, |j| j + 1);
                    let lead = text[line_start..i].trim();
                    // A `use` item (perhaps `pub`), not the word in a string.
                    if !(lead.is_empty() || lead.starts_with("pub")) {
                        continue;
                    }
                    let Some(end) = text[i..].find(';') else { continue };
                    let mut items = Vec::new();
                    expand_use(&text[i + 4..i + end], &mut items);
                    for (path, alias) in items {
                        if let Some(abs) = absolute(&within(i), &path) {
                            if lead.starts_with("pub") {
                                exports.insert(alias, abs.clone());
                            }
                            uses.push(abs);
                        }
                    }
                }
                // Inline paths (`crate::a::b(...)`), outside `use` lines too.
                for start in ["crate::", "super::", "self::"] {
                    for (i, _) in text.match_indices(start) {
                        if text[..i]
                            .chars()
                            .last()
                            .is_some_and(|ch| is_ident(ch) || ch == ':')
                        {
                            continue;
                        }
                        let end = text[i..]
                            .find(|ch: char| !(is_ident(ch) || ch == ':'))
                            .map_or(text.len(), |j| i + j);
                        if let Some(abs) = absolute(&within(i), text[i..end].trim_end_matches(':')) {
                            uses.push(abs);
                        }
                    }
                }
                c.reexports.insert(m.clone(), exports);
                c.paths.insert(m.clone(), uses);
                c.files.insert(m, rel);
            }
        }
        c
    }

    /// The file that defines what `path` names, through re-exports.
    fn resolve(&self, path: &ModPath, depth: usize) -> Option<ModPath> {
        if depth > 16 {
            return None;
        }
        // The longest prefix that is a module file.
        let k = (0..=path.len())
            .rev()
            .find(|&k| self.files.contains_key(&path[..k]))?;
        let module = path[..k].to_vec();
        if let Some(next) = path.get(k)
            && let Some(target) = self.reexports.get(&module).and_then(|r| r.get(next))
        {
            let mut t = target.clone();
            t.extend(path[k + 1..].iter().cloned());
            if &t != path {
                return self.resolve(&t, depth + 1);
            }
        }
        Some(module)
    }

    fn edges(&self) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
        let mut edges = BTreeMap::new();
        for (m, paths) in &self.paths {
            let out: &mut BTreeSet<ModPath> = edges.entry(m.clone()).or_default();
            for p in paths {
                let Some(t) = self.resolve(p, 0) else { continue };
                // How each path resolves, for one file (see the module docs).
                if std::env::var("LAYERS_DEBUG").is_ok_and(|f| self.files[m] == f) {
                    println!("{} -> {}", p.join("::"), self.files.get(&t).map_or("?", |f| f));
                }
                // A module's own children (declared and re-exported) are its structure.
                if t != *m && !t.starts_with(m) && !t.is_empty() {
                    out.insert(t);
                }
            }
        }
        edges
    }
}

/// Strongly connected sets of more than one file.
fn circles(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<ModPath>> {
    struct T<'a> {
        edges: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on: BTreeSet<&'a ModPath>,
        out: Vec<Vec<ModPath>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a ModPath) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.edges.get(v).into_iter().flatten() {
            let Some((w, _)) = t.edges.get_key_value(w) else {
                continue;
            };
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_file_imports_one_that_imports_it_back() {
    let c = Crate::read(&src());
    let edges = c.edges();
    let name = |m: &ModPath| c.files[m].clone();
    for (m, out) in &edges {
        println!(
            "{} -> {}",
            name(m),
            out.iter().map(name).collect::<Vec<_>>().join(", ")
        );
    }
    let found = circles(&edges);
    let text: Vec<String> = found
        .iter()
        .map(|comp| {
            let mut names: Vec<String> = comp.iter().map(name).collect();
            names.sort();
            names.join(", ")
        })
        .collect();
    assert!(
        found.is_empty(),
        "import circles among files:\n{}",
        text.join("\n")
    );
    assert!(
        edges.len() > 30,
        "read only {} files: is src/ there?",
        edges.len()
    );
}

#[test]
fn every_import_points_down_a_layer_or_stays_in_its_own() {
    let c = Crate::read(&src());
    let mut up = Vec::new();
    for (m, out) in c.edges() {
        let file = &c.files[&m];
        let Some((from, from_name)) = layer(file) else {
            continue;
        };
        for t in out {
            let target = &c.files[&t];
            let Some((to, to_name)) = layer(target) else {
                continue;
            };
            if to > from {
                up.push(format!("{file} ({from_name}) imports {target} ({to_name})"));
            }
        }
    }
    for f in c.files.values() {
        assert!(
            f == "lib.rs" || layer(f).is_some(),
            "{f} is in no layer: add it to tests/layers.rs"
        );
    }
    assert!(up.is_empty(), "imports up a layer:\n{}", up.join("\n"));
}

#[test]
fn the_checker_sees_an_import_through_a_reexport_and_a_circle() {
    // The checker's own cases, on a made-up crate: `a` imports `b::Thing`, re-exported by
    // `b/mod.rs` (in a list) from `b/inner.rs`, which imports `super::super::a` (and, in an
    // inline module, `super::Thing`: itself): a circle through a re-export, which a checker
    // reading only `mod.rs` files would miss.
    let dir = std::env::temp_dir().join(format!("handoff-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("b")).expect("scratch");
    std::fs::write(dir.join("lib.rs"), "mod a; mod b;\n").expect("write");
    std::fs::write(dir.join("a.rs"), "use crate::b::Thing; // crate::nothing\n").expect("write");
    std::fs::write(
        dir.join("b/mod.rs"),
        "mod inner;\npub use inner::{Other, Thing};\n",
    )
    .expect("write");
    std::fs::write(
        dir.join("b/inner.rs"),
        "pub struct Other;\npub struct Thing;\nmod tests {\n    use super::Thing;\n}\nfn f() { super::super::a::g() }\n",
    )
    .expect("write");
    let c = Crate::read(&dir);
    let edges = c.edges();
    let a: ModPath = vec!["a".into()];
    let inner: ModPath = vec!["b".into(), "inner".into()];
    assert!(edges[&a].contains(&inner), "{edges:?}");
    assert!(edges[&inner].contains(&a), "{edges:?}");
    assert_eq!(circles(&edges).len(), 1);
    assert_eq!(
        edges[&inner].len(),
        1,
        "an inline module's `super` is its file: {edges:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
