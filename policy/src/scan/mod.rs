//! What a cell does, read from its syntax tree: the modules it imports, the dotted names
//! it calls or refers to (through the aliases it and earlier cells bound), and the shell
//! commands it runs through IPython.
//!
//! Names are resolved as paths: `o.system` with `import os as o` is `os.system`,
//! `getattr(os, "system")` is `os.system`, `__import__("os").system` is `os.system`, and
//! `get_ipython().system` is IPython's shell escape. A name bound to several things (in
//! this cell or an earlier one) stands for all of them: the scan over-approximates.

use crate::ipython;
use rustpython_ast::{self as ast, Visitor};
use std::collections::{BTreeSet, HashMap};

/// The deepest syntax tree walked; deeper code is not judged (see [`Limit`]).
pub const MAX_NESTING: usize = 1000;
/// Code (from `exec("...")`, a magic's argument, a cell magic's body) scanned inside code,
/// at most this many levels down.
const MAX_INNER: usize = 4;
/// Bindings remembered per kernel, and targets per name.
const MAX_NAMES: usize = 4096;
const MAX_TARGETS: usize = 16;
/// Paths resolved from one reference, at most.
const MAX_RESOLVED: usize = 32;

/// Line magics that run shell commands: IPython's own, and its default aliases (each runs
/// the shell command of that name).
pub const SHELL_LINE_MAGICS: &[&str] = &[
    "system",
    "sx",
    "sc",
    "pip",
    "conda",
    "mamba",
    "micromamba",
    "uv",
    "alias",
    "rehashx",
    "bash",
    "sh",
    "script",
    "ls",
    "cat",
    "cp",
    "mv",
    "rm",
    "mkdir",
    "rmdir",
    "ll",
    "lf",
    "lk",
    "lx",
    "ldir",
    "less",
    "more",
    "man",
    "clear",
];
/// Cell magics that hand their body to a shell or another interpreter.
const SHELL_CELL_MAGICS: &[&str] = &[
    "bash", "sh", "script", "system", "!", "sx", "sc", "perl", "ruby", "python", "python2",
    "python3", "pypy",
];
/// Magics whose argument (line) or body (cell) is Python that runs.
pub const PYTHON_LINE_MAGICS: &[&str] = &["time", "timeit", "prun", "debug"];
const PYTHON_CELL_MAGICS: &[&str] = &["time", "timeit", "prun", "debug", "capture"];

/// Why a cell could not be judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Limit {
    /// It (or code inside it) does not parse.
    Parse(String),
    /// Nested deeper than [`MAX_NESTING`], or code-in-code deeper than the scanner follows.
    TooDeep,
}

/// What a cell does, as the rules match it.
#[derive(Debug, Default, Clone)]
pub struct Findings {
    /// Modules imported, dotted, in order (`from a import b` gives `a` and `a.b`).
    pub imports: Vec<String>,
    /// Dotted names called (true) or referred to (false), resolved.
    pub names: Vec<(String, bool)>,
    /// Shell commands, as people read them (`!ls`, `%%bash`, `%system id`).
    pub shell: Vec<String>,
    /// `%pip install NAME...` lines that name packages and nothing else (no other option,
    /// no shell syntax, no IPython expansion): as shown, and the normalized names. They
    /// count as shell commands unless every name is on the gateway's allowlist.
    pub installs: Vec<(String, Vec<String>)>,
    /// Parts that could not be judged; the first one.
    pub limit: Option<Limit>,
}

/// Aliases a kernel's earlier cells bound: name to the dotted paths it may stand for, and
/// the modules star-imported. Kept per kernel, since its namespace outlives a cell.
#[derive(Debug, Default, Clone)]
pub struct Scope {
    names: HashMap<String, BTreeSet<String>>,
    stars: BTreeSet<String>,
}

impl Scope {
    fn bind(&mut self, name: &str, target: String) {
        if self.names.len() >= MAX_NAMES && !self.names.contains_key(name) {
            return;
        }
        let set = self.names.entry(name.to_owned()).or_default();
        if set.len() < MAX_TARGETS {
            set.insert(target);
        }
    }
}

/// Scans an IPython cell. `scope` gives the aliases of earlier cells and takes this one's.
pub fn cell(code: &str, scope: &mut Scope) -> Findings {
    let mut findings = Findings::default();
    scan_cell(code, scope, &mut findings, 0);
    findings
}

/// Scans a Python expression or statement (a `user_expressions` entry).
pub fn python(code: &str, scope: &mut Scope) -> Findings {
    let mut findings = Findings::default();
    scan_python(code, scope, &mut findings, 0);
    findings
}

/// Scans an IPython cell; false if it does not parse.
fn scan_cell(code: &str, scope: &mut Scope, out: &mut Findings, inner: usize) -> bool {
    let transformed = ipython::transform_cell(code);
    if let Some((name, args)) = ipython::automagic(&transformed, SHELL_LINE_MAGICS) {
        shell_magic(name, args, out);
    }
    if let Some((name, args)) = ipython::automagic(&transformed, PYTHON_LINE_MAGICS) {
        python_argument(args, scope, out, inner + 1);
        let _ = name;
    }
    let parsed = scan_python(&transformed, scope, out, inner);
    if !parsed {
        // With autocall on, `f a` on a line of its own runs `f(a)`.
        if let Some((ifun, rest)) = ipython::split_ifun(transformed.trim_end()) {
            if !rest.trim().is_empty() && !ifun.starts_with('.') {
                let mut extra = Findings::default();
                if scan_python(&format!("{ifun}()"), scope, &mut extra, inner + 1) {
                    out.names.extend(extra.names);
                    out.imports.extend(extra.imports);
                    out.shell.extend(extra.shell);
                }
            }
        }
    }
    parsed
}

/// Parses and walks Python; false (with `out.limit` set) if it does not parse.
fn scan_python(code: &str, scope: &mut Scope, out: &mut Findings, inner: usize) -> bool {
    if inner > MAX_INNER {
        out.limit.get_or_insert(Limit::TooDeep);
        return false;
    }
    let suite = match rustpython_parser::parse(code, rustpython_parser::Mode::Module, "<cell>") {
        Ok(ast::Mod::Module(m)) => m.body,
        Ok(_) => Vec::new(),
        Err(e) => {
            out.limit.get_or_insert(Limit::Parse(e.error.to_string()));
            return false;
        }
    };
    let mut walk = Walk::default();
    for stmt in suite {
        walk.visit_stmt(stmt);
    }
    if walk.too_deep {
        out.limit.get_or_insert(Limit::TooDeep);
    }
    // Bindings first (a function may call a name bound after it), then what they mean.
    let cell_names: Vec<(String, Path)> = walk.bindings;
    let mut local = Scope {
        names: HashMap::new(),
        stars: scope.stars.clone(),
    };
    local.stars.extend(walk.stars.iter().cloned());
    let resolver = Resolver {
        cell: &cell_names,
        earlier: scope,
        stars: &local.stars,
    };
    let mut bound: Vec<(String, String)> = Vec::new();
    for (name, path) in &cell_names {
        for target in resolver.resolve(path, 0) {
            bound.push((name.clone(), target));
        }
    }
    let mut inner_code: Vec<(InnerKind, String)> = Vec::new();
    out.imports.extend(walk.imports);
    for r in &walk.refs {
        for name in resolver.resolve(&r.path, 0) {
            classify(&name, r, out, &mut inner_code);
            out.names.push((name, r.called));
        }
    }
    // A name this cell bound to a plain value no longer stands for what it aliased.
    for name in &walk.rebound {
        if !cell_names.iter().any(|(n, _)| n == name) {
            scope.names.remove(name);
        }
    }
    for (name, target) in bound {
        scope.bind(&name, target);
    }
    scope.stars.extend(walk.stars);
    for (kind, code) in inner_code {
        match kind {
            InnerKind::Python => {
                let mut inner_out = Findings::default();
                scan_python(&code, scope, &mut inner_out, inner + 1);
                merge(out, inner_out, false);
            }
            InnerKind::Cell => {
                let mut inner_out = Findings::default();
                scan_cell(&code, scope, &mut inner_out, inner + 1);
                merge(out, inner_out, false);
            }
            InnerKind::Argument => python_argument(&code, scope, out, inner + 1),
        }
    }
    true
}

/// Adds what inner code does. Inner code that does not parse fails at run time in the
/// kernel too, so only its depth limit carries over.
fn merge(out: &mut Findings, inner: Findings, parse_errors_count: bool) {
    out.imports.extend(inner.imports);
    out.names.extend(inner.names);
    out.shell.extend(inner.shell);
    match inner.limit {
        Some(Limit::TooDeep) => {
            out.limit.get_or_insert(Limit::TooDeep);
        }
        Some(l @ Limit::Parse(_)) if parse_errors_count => {
            out.limit.get_or_insert(l);
        }
        _ => {}
    }
}

/// A magic's argument that is code after options (`%timeit -n 10 f(x)`, read as a cell:
/// `%time !ls` runs the shell): the longest tail that parses is scanned, and so is each
/// quoted option value (`-s "setup"`).
fn python_argument(args: &str, scope: &mut Scope, out: &mut Findings, inner: usize) {
    let words: Vec<usize> = std::iter::once(0)
        .chain(
            args.char_indices()
                .filter(|(i, c)| c.is_whitespace() && *i + 1 < args.len())
                .map(|(i, c)| i + c.len_utf8()),
        )
        .collect();
    for start in words {
        let tail = &args[start..];
        if tail.trim().is_empty() {
            continue;
        }
        let mut tail_out = Findings::default();
        if scan_cell(tail.trim_start(), scope, &mut tail_out, inner) {
            merge(out, tail_out, false);
            break;
        }
        if tail_out.limit == Some(Limit::TooDeep) {
            out.limit.get_or_insert(Limit::TooDeep);
            return;
        }
    }
    for quoted in quoted_parts(args) {
        let mut q = Findings::default();
        scan_python(&quoted, scope, &mut q, inner);
        merge(out, q, false);
    }
}

fn quoted_parts(s: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '"' || c == '\'' {
            let body: String = chars.by_ref().take_while(|x| *x != c).collect();
            parts.push(body);
        }
    }
    parts
}

#[derive(Debug, Clone, Copy)]
enum InnerKind {
    /// Python: `exec("...")`, `eval`, `compile`.
    Python,
    /// An IPython cell: `get_ipython().run_cell("...")`, a Python cell magic's body.
    Cell,
    /// A Python magic's argument, after its options.
    Argument,
}

const IMPORTERS: &[&str] = &[
    "__import__",
    "builtins.__import__",
    "importlib.import_module",
    "importlib.__import__",
    "importlib.util.find_spec",
    "runpy.run_module",
    "pkgutil.resolve_name",
];
const EVALUATORS: &[&str] = &[
    "exec",
    "eval",
    "compile",
    "builtins.exec",
    "builtins.eval",
    "builtins.compile",
];

/// What a resolved call means beyond its name: an import by string, code in a string, or
/// one of IPython's entry points.
fn classify(name: &str, r: &Ref, out: &mut Findings, inner: &mut Vec<(InnerKind, String)>) {
    if !r.called {
        return;
    }
    let arg = |i: usize| r.strings.get(i).and_then(|s| s.as_deref());
    if IMPORTERS.contains(&name) {
        if let Some(m) = arg(0) {
            let m = m.trim_start_matches('.');
            let m = m.split(':').next().unwrap_or(m);
            if !m.is_empty() {
                out.imports.push(m.to_owned());
            }
        }
        return;
    }
    if EVALUATORS.contains(&name) {
        if let Some(code) = arg(0) {
            inner.push((InnerKind::Python, code.to_owned()));
        }
        return;
    }
    let Some((receiver, method)) = name.rsplit_once('.') else {
        return;
    };
    if !receiver.ends_with("get_ipython()") {
        return;
    }
    match method {
        "system" | "system_raw" | "system_piped" | "getoutput" => {
            out.shell.push(format!("!{}", arg(0).unwrap_or("…")));
        }
        "run_line_magic" | "magic" => {
            let (magic, args) = match (method, arg(0), arg(1)) {
                ("magic", Some(line), _) => {
                    let line = line.trim_start_matches('%');
                    line.split_once(' ').unwrap_or((line, ""))
                }
                (_, Some(m), a) => (m.trim_start_matches('%'), a.unwrap_or("")),
                // A magic chosen at run time may be any of them.
                _ => {
                    out.shell.push("a magic chosen at run time".into());
                    return;
                }
            };
            line_magic(magic, args, out, inner);
        }
        "run_cell_magic" => match (arg(0), arg(1), arg(2)) {
            (Some(magic), line, body) => {
                let magic = magic.trim_start_matches('%');
                if SHELL_CELL_MAGICS.contains(&magic) {
                    let first = line.unwrap_or("").trim();
                    out.shell
                        .push(format!("%%{magic} {first}").trim_end().to_owned());
                } else if PYTHON_CELL_MAGICS.contains(&magic) {
                    if let Some(body) = body {
                        inner.push((InnerKind::Cell, body.to_owned()));
                    }
                    if let Some(line) = line {
                        inner.push((InnerKind::Argument, line.to_owned()));
                    }
                }
            }
            _ => out.shell.push("a cell magic chosen at run time".into()),
        },
        "run_cell" | "run_cell_async" | "ex" | "ev" | "safe_execfile_ipy" => {
            if let Some(code) = arg(0) {
                inner.push((InnerKind::Cell, code.to_owned()));
            }
        }
        _ => {}
    }
}

fn line_magic(magic: &str, args: &str, out: &mut Findings, inner: &mut Vec<(InnerKind, String)>) {
    if SHELL_LINE_MAGICS.contains(&magic) {
        shell_magic(magic, args, out);
    } else if PYTHON_LINE_MAGICS.contains(&magic) {
        inner.push((InnerKind::Argument, args.to_owned()));
    } else if magic == "run" || magic == "load_ext" || magic == "reload_ext" {
        // `%run -m mod` and `%load_ext mod` import that module.
        let mut words = args.split_whitespace();
        let module = match (magic, words.next()) {
            ("run", Some("-m")) => words.next(),
            ("run", _) => None,
            (_, first) => first,
        };
        if let Some(m) = module {
            out.imports.push(m.to_owned());
        }
    }
}

/// A shell magic: an install of named packages (`%pip install seaborn "tqdm>=4"`) or a
/// shell command.
fn shell_magic(magic: &str, args: &str, out: &mut Findings) {
    let shown = format!("%{magic} {args}").trim_end().to_owned();
    match (magic, pip_install_names(args)) {
        ("pip", Some(names)) => out.installs.push((shown, names)),
        _ => out.shell.push(shown),
    }
}

/// The normalized package names of `install [-q|-U...] REQ...` when that is all the line
/// says. IPython hands the line to `/bin/sh` after expanding `{expr}` and `$name`, so any
/// character either would act on makes it a shell command: only names, version
/// specifiers and extras remain, the specifiers' `<`, `>`, `!`, `~`, `[`, `,` and spaces
/// only inside quotes.
pub fn pip_install_names(args: &str) -> Option<Vec<String>> {
    let mut words = args.split_whitespace();
    if words.next()? != "install" {
        return None;
    }
    let rest: Vec<&str> = words.collect();
    let line = rest.join(" ");
    if line.contains([
        '{', '}', '$', '`', '\\', ';', '&', '|', '(', ')', '\n', '#', '*', '?',
    ]) {
        return None;
    }
    let mut names = Vec::new();
    let mut chars = line.chars().peekable();
    while chars.peek().is_some() {
        let mut word = String::new();
        while let Some(&c) = chars.peek() {
            if c == ' ' {
                chars.next();
                break;
            }
            if c == '"' || c == '\'' {
                chars.next();
                let mut closed = false;
                for q in chars.by_ref() {
                    if q == c {
                        closed = true;
                        break;
                    }
                    if !(q.is_ascii_alphanumeric() || "._-=<>!~,[] ".contains(q)) {
                        return None;
                    }
                    word.push(q);
                }
                if !closed {
                    return None;
                }
                continue;
            }
            if !(c.is_ascii_alphanumeric() || "._-=".contains(c)) {
                return None;
            }
            word.push(c);
            chars.next();
        }
        let word = word.trim();
        if word.is_empty() {
            continue;
        }
        match word {
            "-q" | "--quiet" | "-U" | "--upgrade" => continue,
            w if w.starts_with('-') => return None,
            w => {
                let end = w
                    .find(|c: char| !(c.is_ascii_alphanumeric() || "._-".contains(c)))
                    .unwrap_or(w.len());
                if end == 0 {
                    return None;
                }
                names.push(normalize(&w[..end]));
            }
        }
    }
    (!names.is_empty()).then_some(names)
}

/// A project name as PEP 503 compares them: lowercase, `-`, `_` and `.` runs as one `-`.
fn normalize(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if "-_.".contains(c) {
            if !out.ends_with('-') {
                out.push('-');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

mod walk;
use walk::{Path, Ref, Resolver, Walk};
