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
            && matches!(&a.meta, syn::Meta::List(l) if l.tokens.to_string().trim() == "test")
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
    /// The last segment of every path named here (`ENGINE_QUIET_MS`, `engine_health`, …),
    /// and every identifier inside a macro's tokens.
    named: BTreeSet<String>,
    /// Every path, as its segments joined by `::` (`crate::store::Store`, `rusqlite::params`).
    paths: BTreeSet<String>,
    /// `use crate::*` or `use super::*` reaching past the file's own module.
    globs: BTreeSet<String>,
    /// An or-pattern naming both `Assigned` and `Accepted`: "work is open" spelled again.
    open_work_pattern: bool,
    /// Transactions composed here: `.read(|tx| …)`, `.write(…)`, `.write_synced(…)` (or
    /// `Store::write(s, …)`) given a closure, or a local bound to one, also inside a macro's
    /// tokens, by method name.
    closure_transactions: BTreeSet<String>,
    /// Locals bound to a closure (`let work = |tx| …;`), so a transaction handed one counts.
    closures: BTreeSet<String>,
}

/// An expression without the parentheses, references and casts around it.
fn bare(e: &syn::Expr) -> &syn::Expr {
    match e {
        syn::Expr::Paren(p) => bare(&p.expr),
        syn::Expr::Reference(r) => bare(&r.expr),
        syn::Expr::Group(g) => bare(&g.expr),
        _ => e,
    }
}

const TRANSACTIONS: [&str; 3] = ["read", "write", "write_synced"];

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

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        let mut prefix = Vec::new();
        self.use_paths(&u.tree, &mut prefix);
        if let syn::UseTree::Path(p) = &u.tree
            && p.ident == "crate"
        {
            let mut names = Vec::new();
            first_names(&p.tree, &mut names);
            self.crate_refs.extend(names);
        }
    }

    /// Macro bodies are tokens to `syn`: their identifiers and string literals count too
    /// (SQL in `format!`, a call inside `json!`).
    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.tokens(m.tokens.clone());
        syn::visit::visit_macro(self, m);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if let Some(last) = path.segments.last() {
            self.named.insert(last.ident.to_string());
        }
        self.paths.insert(
            path.segments
                .iter()
                .map(|s| s.ident.to_string())
                .collect::<Vec<_>>()
                .join("::"),
        );
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
        let method = call.method.to_string();
        if TRANSACTIONS.contains(&method.as_str()) && call.args.iter().any(|a| self.is_closure(a)) {
            self.closure_transactions.insert(method);
        }
        syn::visit::visit_expr_method_call(self, call);
    }

    /// `Store::write(&mut s, |tx| …)`: the method called through its type.
    fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
        if let syn::Expr::Path(p) = bare(&call.func)
            && p.path.segments.len() >= 2
            && let Some(last) = p.path.segments.last()
            && TRANSACTIONS.contains(&last.ident.to_string().as_str())
            && call.args.iter().any(|a| self.is_closure(a))
        {
            self.closure_transactions.insert(last.ident.to_string());
        }
        syn::visit::visit_expr_call(self, call);
    }

    fn visit_local(&mut self, local: &'ast syn::Local) {
        if let syn::Pat::Ident(name) = &local.pat
            && let Some(init) = &local.init
            && matches!(bare(&init.expr), syn::Expr::Closure(_))
        {
            self.closures.insert(name.ident.to_string());
        }
        syn::visit::visit_local(self, local);
    }

    fn visit_pat_or(&mut self, p: &'ast syn::PatOr) {
        let names: BTreeSet<String> = p
            .cases
            .iter()
            .filter_map(|c| match c {
                syn::Pat::Path(pp) => pp.path.segments.last().map(|s| s.ident.to_string()),
                syn::Pat::Ident(i) => Some(i.ident.to_string()),
                _ => None,
            })
            .collect();
        if names.contains("Assigned") && names.contains("Accepted") {
            self.open_work_pattern = true;
        }
        syn::visit::visit_pat_or(self, p);
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
    fn use_paths(&mut self, tree: &syn::UseTree, prefix: &mut Vec<String>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_paths(&p.tree, prefix);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut full = prefix.clone();
                full.push(n.ident.to_string());
                self.paths.insert(full.join("::"));
                self.named.insert(n.ident.to_string());
            }
            syn::UseTree::Rename(r) => {
                let mut full = prefix.clone();
                full.push(r.ident.to_string());
                self.paths.insert(full.join("::"));
                self.named.insert(r.ident.to_string());
            }
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| self.use_paths(t, prefix)),
            syn::UseTree::Glob(_) => {
                self.globs.insert(prefix.join("::"));
                self.paths.insert(prefix.join("::"));
            }
        }
    }

    /// A closure, or a local bound to one.
    fn is_closure(&self, e: &syn::Expr) -> bool {
        match bare(e) {
            syn::Expr::Closure(_) => true,
            syn::Expr::Path(p) => p
                .path
                .get_ident()
                .is_some_and(|i| self.closures.contains(&i.to_string())),
            _ => false,
        }
    }

    fn tokens(&mut self, stream: proc_macro2::TokenStream) {
        use proc_macro2::{Delimiter, TokenTree};
        let trees: Vec<TokenTree> = stream.into_iter().collect();
        // `. read ( | …` (or `move |`) in a macro's tokens: a transaction composed there.
        for w in trees.windows(3) {
            if let (TokenTree::Punct(dot), TokenTree::Ident(m), TokenTree::Group(g)) =
                (&w[0], &w[1], &w[2])
                && dot.as_char() == '.'
                && TRANSACTIONS.contains(&m.to_string().as_str())
                && g.delimiter() == Delimiter::Parenthesis
                && g.stream().into_iter().next().is_some_and(|t| match t {
                    TokenTree::Punct(p) => p.as_char() == '|',
                    TokenTree::Ident(i) => i == "move",
                    _ => false,
                })
            {
                self.closure_transactions.insert(m.to_string());
            }
        }
        // `crate` then `::` (two puncts) then a name: a path into a top-level module.
        let mut after_crate = 0;
        let mut or_names = BTreeSet::new();
        let mut has_bar = false;
        // `a :: b :: c` as one path (two ':' puncts between names).
        let mut path: Vec<String> = Vec::new();
        let mut colons = 0;
        for (i, tree) in trees.iter().enumerate() {
            after_crate = match tree {
                TokenTree::Ident(id) if id == "crate" => 1,
                TokenTree::Punct(p) if p.as_char() == ':' && after_crate > 0 => after_crate + 1,
                TokenTree::Ident(id) if after_crate == 3 => {
                    self.crate_refs.insert(id.to_string());
                    0
                }
                _ => 0,
            };
            match tree {
                TokenTree::Group(g) => self.tokens(g.stream()),
                TokenTree::Ident(id) => {
                    let name = id.to_string();
                    if colons == 2 && !path.is_empty() {
                        path.push(name.clone());
                        self.paths.insert(path.join("::"));
                    } else {
                        path = vec![name.clone()];
                    }
                    colons = 0;
                    // `. name (`: a method call.
                    let after_dot =
                        i > 0 && matches!(&trees[i - 1], TokenTree::Punct(p) if p.as_char() == '.');
                    let called = matches!(
                        trees.get(i + 1),
                        Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Parenthesis
                    );
                    if after_dot && called {
                        self.method_calls.insert(name.clone());
                    }
                    if name == "Assigned" || name == "Accepted" {
                        or_names.insert(name.clone());
                    }
                    self.named.insert(name);
                }
                TokenTree::Literal(l) => {
                    if let Ok(lit) = syn::parse_str::<syn::LitStr>(&l.to_string()) {
                        self.literals.push(lit.value());
                    }
                }
                TokenTree::Punct(p) => {
                    has_bar |= p.as_char() == '|';
                    colons = if p.as_char() == ':' { colons + 1 } else { 0 };
                }
            }
            if matches!(tree, TokenTree::Group(_) | TokenTree::Literal(_)) {
                colons = 0;
                path.clear();
            }
        }
        if or_names.len() == 2 && has_bar {
            self.open_work_pattern = true;
        }
    }

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

/// Whether a string holds SQL (any case): a statement's keywords in their order.
fn is_sql(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    let has = |a: &str, b: &str| t.find(a).is_some_and(|i| t[i..].contains(b));
    t.contains("insert into")
        || t.contains("delete from")
        || t.contains("begin immediate")
        || t.contains("pragma ")
        || has("select ", " from ")
        || has("update ", " set ")
}

/// What breaks "fronts never open the store nor read SQL" in the front file `rel`.
fn front_problems(rel: &str, f: &Facts) -> Vec<String> {
    let mut problems = Vec::new();
    if f.crate_refs.contains("store") {
        problems.push(format!("{rel} imports crate::store"));
    }
    for path in &f.paths {
        let segments: Vec<&str> = path.split("::").collect();
        let store_below_root = segments
            .windows(2)
            .any(|w| matches!(w[0], "crate" | "super") && w[1] == "store");
        if store_below_root || segments.first() == Some(&"rusqlite") {
            problems.push(format!("{rel} names {path}"));
        }
    }
    for glob in &f.globs {
        if glob == "crate" || glob.starts_with("super::super") {
            problems.push(format!("{rel} imports everything of {glob}"));
        }
    }
    if f.named.contains("store_mut") || f.method_calls.contains("store_mut") {
        problems.push(format!(
            "{rel} calls store_mut, the delivery side's store access"
        ));
    }
    if f.method_calls.contains("runs") || f.paths.iter().any(|p| p.ends_with("::runs")) {
        problems.push(format!("{rel} calls .runs(), the adapters' run records"));
    }
    for lit in &f.literals {
        if is_sql(lit) {
            problems.push(format!("{rel} holds SQL: {lit:?}"));
        }
    }
    problems
}

#[test]
fn fronts_never_open_the_store_nor_read_sql() {
    let problems: Vec<String> = facts()
        .iter()
        .filter(|(rel, _)| rel.starts_with("front/"))
        .flat_map(|(rel, f)| front_problems(rel, f))
        .collect();
    assert!(
        problems.is_empty(),
        "fronts render, the service decides:\n{}",
        problems.join("\n")
    );
}

/// Facts of one planted source text.
fn facts_of(text: &str) -> Facts {
    let mut f = Facts::default();
    f.visit_file(&syn::parse_file(text).expect("planted source parses"));
    f
}

#[test]
fn planted_front_violations_are_each_caught() {
    let planted = [
        ("use crate::store::Store;", "imports crate::store"),
        (
            "fn f(s: &mut S) -> V { json!({ \"n\": s.store_mut().x() }) }",
            "store_mut",
        ),
        ("fn f(s: &mut S) { Service::store_mut(s); }", "store_mut"),
        ("fn f(s: &mut S) { s.store_mut().write(g); }", "store_mut"),
        ("fn f(h: &mut H) { Host::runs(h); }", ".runs()"),
        (
            "fn f() -> V { json!({ \"x\": super::super::store::millis(1) }) }",
            "names super::super::store",
        ),
        (
            "fn f() -> V { json!({ \"c\": rusqlite::Connection::open(p) }) }",
            "names rusqlite",
        ),
        ("fn f(h: &mut H) { h.runs(); }", ".runs()"),
        (
            "fn f() -> String { format!(\"select id from agents where x = {}\", 1) }",
            "holds SQL",
        ),
        (
            "const Q: &str = \"UPDATE work SET state = 'closed'\";",
            "holds SQL",
        ),
        ("use crate::*;", "imports everything of crate"),
        (
            "fn f() -> V { json!({ \"s\": crate::store::millis(x) }) }",
            "imports crate::store",
        ),
        (
            "fn f() { let _ = super::super::store::millis; }",
            "names super::super::store",
        ),
        ("fn f(c: &rusqlite::Connection) {}", "names rusqlite"),
    ];
    for (source, expected) in planted {
        let problems = front_problems("front/planted.rs", &facts_of(source));
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{source:?} is not caught as {expected:?}: {problems:?}"
        );
    }
    // Plain words are not SQL, and a field named `runs` is not the call.
    assert!(!is_sql("select the agent to update"));
    assert!(
        front_problems(
            "front/planted.rs",
            &facts_of("fn f(r: &R) -> V { json!({ \"n\": r.runs }) }")
        )
        .is_empty()
    );
    // "Work is open" spelled as a pattern, in code or in a macro, is found.
    for source in [
        "fn f(s: S) -> bool { matches!(s, WorkState::Assigned | WorkState::Accepted) }",
        "fn f(s: S) -> bool { match s { WorkState::Assigned | WorkState::Accepted => true, _ => false } }",
    ] {
        assert!(facts_of(source).open_work_pattern, "{source}");
    }
    assert!(
        !facts_of("fn f(s: S) { if s == WorkState::Accepted { g(WorkState::Assigned) } }")
            .open_work_pattern
    );
}

/// What breaks "only the service and the store compose transactions" in file `rel`: the
/// engine, the adapters, the fronts and the simulation call the store's named transactions
/// (and the service's), so a second backend implements those and nothing else changes.
fn transaction_problems(rel: &str, f: &Facts) -> Vec<String> {
    let mut problems = Vec::new();
    for m in &f.closure_transactions {
        problems.push(format!(
            "{rel} composes a transaction (.{m} with a closure)"
        ));
    }
    if f.named.contains("Tx") {
        problems.push(format!("{rel} names the store's transaction type Tx"));
    }
    if f.named.contains("store_mut") || f.method_calls.contains("store_mut") {
        problems.push(format!(
            "{rel} reaches into the service's store (store_mut)"
        ));
    }
    problems
}

#[test]
fn only_the_service_and_the_store_compose_transactions() {
    let all = facts();
    // The layers this rule is about are among the files read.
    for file in [
        "engine/mod.rs",
        "simulate.rs",
        "adapter/command.rs",
        "front/mcp/mod.rs",
    ] {
        assert!(
            all.iter().any(|(rel, _)| rel == file),
            "{file} is not among the files checked"
        );
    }
    let problems: Vec<String> = all
        .iter()
        .filter(|(rel, _)| !rel.starts_with("service/") && !rel.starts_with("store/"))
        .flat_map(|(rel, f)| transaction_problems(rel, f))
        .collect();
    assert!(
        problems.is_empty(),
        "the store's API is its named transactions:\n{}",
        problems.join("\n")
    );
}

#[test]
fn planted_transactions_outside_the_service_are_each_caught() {
    let planted = [
        (
            "fn f(s: &mut S) { s.read(|tx| tx.due(1)); }",
            ".read with a closure",
        ),
        (
            "fn f(s: &mut S) { let _ = s.write(move |tx| { tx.set_due(a, b) }); }",
            ".write with a closure",
        ),
        (
            "fn f(s: &mut S) { s.write_synced(|t| g(t)); }",
            ".write_synced",
        ),
        ("fn f(t: &Tx<'_>) {}", "Tx"),
        ("fn f(s: &mut S) { s.store_mut().due(1); }", "store_mut"),
        (
            "fn f(s: &mut S) { let work = |tx: &T| g(tx); s.write(work); }",
            ".write with a closure",
        ),
        (
            "fn f(s: &mut S) { Store::write(&mut s, |tx| g(tx)); }",
            ".write with a closure",
        ),
        (
            "fn f(s: &mut S) { s.read((|tx| g(tx))); }",
            ".read with a closure",
        ),
        (
            "async fn f(s: &mut S) { tokio::select! { _ = x => s.read(|tx| g(tx)) } }",
            ".read with a closure",
        ),
        (
            "fn f(s: &mut S) { m!(s.write(move |tx| g(tx))); }",
            ".write with a closure",
        ),
    ];
    for (text, expected) in planted {
        let problems = transaction_problems("engine/mod.rs", &facts_of(text));
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "not caught: {text:?} (found {problems:?})"
        );
    }
    // A named transaction, and a read of something else, are fine.
    for text in [
        "fn f(s: &mut S) { s.due(1); s.finish_run(a, b, None, c, None); }",
        "fn f(f: &mut File) { f.read(&mut buf); f.write(b\"x\"); }",
    ] {
        assert!(
            transaction_problems("engine/mod.rs", &facts_of(text)).is_empty(),
            "wrongly caught: {text:?}"
        );
    }
}

#[test]
fn planted_long_functions_and_test_code_are_told_apart() {
    let body = "    let _ = 1;\n".repeat(FUNCTION_LINES_MAX);
    let long = format!("fn long() {{\n{body}}}\n");
    assert_eq!(
        facts_of(&long).long_functions.len(),
        1,
        "a long function is caught"
    );
    let in_tests = format!("#[cfg(test)]\nmod tests {{\n{long}}}\n");
    assert!(
        facts_of(&in_tests).long_functions.is_empty(),
        "test code is not counted"
    );
    let not_test = format!("#[cfg(not(test))]\nmod real {{\n{long}}}\n");
    assert_eq!(
        facts_of(&not_test).long_functions.len(),
        1,
        "cfg(not(test)) is not test code"
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
            let literal = f
                .literals
                .iter()
                .any(|l| l.contains("'assigned', 'accepted'") || l == "assigned");
            literal || f.open_work_pattern
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
