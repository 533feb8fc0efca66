//! The layering rules of docs/ARCHITECTURE.md, checked on the source itself (parsed with
//! `syn`, never matched with patterns): top-level modules import each other without a cycle;
//! fronts never open the store or read SQL; no function outside tests runs over 150 lines;
//! engine liveness, "work is open" and the commit of a delivery step each have one home.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use syn::spanned::Spanned;
use syn::visit::Visit;

const FUNCTION_LINES_MAX: usize = 150;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.expect("a folder entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// Every source file of the library, with its path below `src/` and its parsed syntax.
fn sources() -> Vec<(String, syn::File)> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).expect("a readable source file");
            let file = syn::parse_file(&text)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
            let rel = path
                .strip_prefix(src())
                .expect("below src")
                .to_string_lossy()
                .into_owned();
            (rel, file)
        })
        .collect()
}

/// The top-level module a file belongs to (`service/tasks.rs` → `service`).
fn top_module(rel: &str) -> Option<String> {
    let first = rel.split('/').next()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_owned())
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && matches!(&a.meta, syn::Meta::List(l) if l.tokens.to_string().contains("test"))
    })
}

/// What one file refers to and defines, outside its `#[cfg(test)]` modules.
#[derive(Default)]
struct Facts {
    /// `crate::X` for every top-level module X named in a path or `use`.
    crate_refs: BTreeSet<String>,
    /// Functions over the limit: (name, lines).
    long_functions: Vec<(String, usize)>,
    /// Method calls by name, e.g. `runs`, `save_delivery`.
    method_calls: BTreeSet<String>,
    /// String literals (SQL lives in them).
    literals: Vec<String>,
    /// Free functions and consts defined here, by name.
    defined: BTreeSet<String>,
    /// The last segment of every path named here (`ENGINE_QUIET_MS`, `engine_health`, …).
    named: BTreeSet<String>,
}

impl<'ast> Visit<'ast> for Facts {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_cfg_test(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if is_cfg_test(&f.attrs) {
            return;
        }
        self.defined.insert(f.sig.ident.to_string());
        self.measure(&f.sig.ident, f.span());
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if is_cfg_test(&f.attrs) {
            return;
        }
        self.measure(&f.sig.ident, f.span());
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_item_const(&mut self, c: &'ast syn::ItemConst) {
        self.defined.insert(c.ident.to_string());
        syn::visit::visit_item_const(self, c);
    }

    fn visit_use_tree(&mut self, tree: &'ast syn::UseTree) {
        if let syn::UseTree::Path(p) = tree
            && p.ident == "crate"
        {
            let mut names = Vec::new();
            first_names(&p.tree, &mut names);
            self.crate_refs.extend(names);
            return;
        }
        syn::visit::visit_use_tree(self, tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if let Some(last) = path.segments.last() {
            self.named.insert(last.ident.to_string());
        }
        let mut segments = path.segments.iter();
        if let (Some(first), Some(second)) = (segments.next(), segments.next())
            && first.ident == "crate"
        {
            self.crate_refs.insert(second.ident.to_string());
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        self.method_calls.insert(call.method.to_string());
        syn::visit::visit_expr_method_call(self, call);
    }

    fn visit_lit_str(&mut self, lit: &'ast syn::LitStr) {
        self.literals.push(lit.value());
    }
}

fn first_names(tree: &syn::UseTree, out: &mut Vec<String>) {
    match tree {
        syn::UseTree::Path(p) => out.push(p.ident.to_string()),
        syn::UseTree::Name(n) => out.push(n.ident.to_string()),
        syn::UseTree::Rename(r) => out.push(r.ident.to_string()),
        syn::UseTree::Group(g) => g.items.iter().for_each(|t| first_names(t, out)),
        syn::UseTree::Glob(_) => {}
    }
}

impl Facts {
    fn measure(&mut self, name: &syn::Ident, span: proc_macro2::Span) {
        let lines = span.end().line - span.start().line + 1;
        if lines > FUNCTION_LINES_MAX {
            self.long_functions.push((name.to_string(), lines));
        }
    }
}

fn facts() -> Vec<(String, Facts)> {
    sources()
        .into_iter()
        .map(|(rel, file)| {
            let mut f = Facts::default();
            f.visit_file(&file);
            (rel, f)
        })
        .collect()
}

/// A cycle in `graph`, as the path that closes it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn walk(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = walk(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| walk(n, graph, &mut Vec::new(), &mut done))
}

#[test]
fn top_level_modules_import_each_other_without_a_cycle() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let all = facts();
    let modules: BTreeSet<String> = all.iter().filter_map(|(r, _)| top_module(r)).collect();
    for (rel, f) in &all {
        let Some(from) = top_module(rel) else {
            continue;
        };
        let entry = graph.entry(from.clone()).or_default();
        for to in &f.crate_refs {
            if *to != from && modules.contains(to) {
                entry.insert(to.clone());
            }
        }
    }
    assert!(
        graph.get("store").is_some_and(BTreeSet::is_empty),
        "the store imports {:?}: it is the bottom layer and imports no other module",
        graph.get("store")
    );
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "import cycle between top-level modules: {}",
            cycle.join(" -> ")
        );
    }
}

#[test]
fn fronts_never_open_the_store_nor_read_sql() {
    let sql = [
        "SELECT ",
        "INSERT INTO",
        "UPDATE ",
        "DELETE FROM",
        "BEGIN IMMEDIATE",
    ];
    let mut problems = Vec::new();
    for (rel, f) in facts() {
        if !rel.starts_with("front/") {
            continue;
        }
        if f.crate_refs.contains("store") {
            problems.push(format!("{rel} imports crate::store"));
        }
        for m in ["runs", "store_mut"] {
            if f.method_calls.contains(m) {
                problems.push(format!(
                    "{rel} calls .{m}(), the delivery side's store access"
                ));
            }
        }
        for lit in &f.literals {
            if sql.iter().any(|k| lit.contains(k)) {
                problems.push(format!("{rel} holds SQL: {lit:?}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "fronts render, the service decides:\n{}",
        problems.join("\n")
    );
}

#[test]
fn no_function_outside_tests_runs_over_150_lines() {
    let mut long = Vec::new();
    for (rel, f) in facts() {
        for (name, lines) in f.long_functions {
            long.push(format!("{rel}: fn {name} is {lines} lines"));
        }
    }
    assert!(
        long.is_empty(),
        "functions over {FUNCTION_LINES_MAX} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn each_rule_has_one_home() {
    let all = facts();
    let defined_in = |name: &str| -> Vec<String> {
        all.iter()
            .filter(|(_, f)| f.defined.contains(name))
            .map(|(r, _)| r.clone())
            .collect()
    };
    assert_eq!(
        defined_in("engine_health"),
        ["service/status.rs"],
        "engine liveness is decided in one place"
    );
    assert_eq!(
        defined_in("ENGINE_QUIET_MS"),
        ["service/status.rs"],
        "the engine's quiet limit is defined once"
    );
    let users: Vec<&String> = all
        .iter()
        .filter(|(_, f)| f.named.contains("ENGINE_QUIET_MS"))
        .map(|(r, _)| r)
        .collect();
    assert_eq!(
        users,
        ["service/status.rs"],
        "the engine's quiet limit is used by the liveness rule alone"
    );
    let callers: Vec<&String> = all
        .iter()
        .filter(|(_, f)| f.method_calls.contains("save_delivery"))
        .map(|(r, _)| r)
        .collect();
    assert_eq!(
        callers,
        ["service/deliveries.rs"],
        "a delivery step is committed on one path (Service::commit_step)"
    );
    let open_work: Vec<&String> = all
        .iter()
        .filter(|(_, f)| {
            f.literals
                .iter()
                .any(|l| l.contains("'assigned', 'accepted'") || l == "assigned")
        })
        .map(|(r, _)| r)
        .collect();
    assert!(
        open_work.iter().all(|r| r.starts_with("store/")),
        "\"work is open\" is model::work::WorkState::is_open (and the store's one OPEN_WORK \
         clause); spelled again in {open_work:?}"
    );
}

#[test]
fn a_planted_cycle_is_found() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("engine", vec!["service", "adapter"]),
        ("service", vec!["adapter", "store"]),
        ("adapter", vec!["store", "service"]),
        ("store", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(
        find_cycle(&graph).map(|c| c.join(" -> ")),
        Some("adapter -> service -> adapter".to_owned())
    );
}
