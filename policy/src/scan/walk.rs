//! Walking a cell's syntax tree: each name resolved to the paths it may stand for, through
//! the aliases bound so far, and each call or reference handed on to be classified.

use super::{Scope, MAX_NESTING, MAX_RESOLVED};
use rustpython_ast::{self as ast, Constant, Expr, Visitor};
use std::collections::BTreeSet;

/// A name as the code spells it: a root and the attributes after it.
#[derive(Debug, Clone)]
pub(super) struct Path {
    pub(super) root: Root,
    pub(super) attrs: Vec<String>,
}

#[derive(Debug, Clone)]
pub(super) enum Root {
    /// A variable, resolved through the aliases.
    Name(String),
    /// A module named by a string or an import.
    Module(String),
    /// The result of calling a path with no arguments (`get_ipython()`).
    Called(Box<Path>),
}

/// A reference to a path in the code, called or not, with the string constants of its
/// call's positional arguments.
#[derive(Debug)]
pub(super) struct Ref {
    pub(super) path: Path,
    pub(super) called: bool,
    pub(super) strings: Vec<Option<String>>,
}

pub(super) struct Resolver<'a> {
    pub(super) cell: &'a [(String, Path)],
    pub(super) earlier: &'a Scope,
    pub(super) stars: &'a BTreeSet<String>,
}

impl Resolver<'_> {
    /// Every dotted name a path may stand for.
    pub(super) fn resolve(&self, path: &Path, depth: usize) -> Vec<String> {
        let roots: Vec<String> = match &path.root {
            Root::Module(m) => vec![m.clone()],
            Root::Called(inner) if depth < 8 => self
                .resolve(inner, depth + 1)
                .into_iter()
                .map(|s| format!("{s}()"))
                .collect(),
            Root::Called(_) => Vec::new(),
            Root::Name(n) => {
                let mut all: Vec<String> = Vec::new();
                let mut aliased = false;
                if depth < 8 {
                    for (name, target) in self.cell {
                        if name == n {
                            aliased = true;
                            all.extend(self.resolve(target, depth + 1));
                        }
                    }
                }
                if let Some(targets) = self.earlier.names.get(n) {
                    aliased = true;
                    all.extend(targets.iter().cloned());
                }
                if !aliased {
                    all.push(n.clone());
                    all.extend(self.stars.iter().map(|m| format!("{m}.{n}")));
                }
                all
            }
        };
        let mut out: Vec<String> = Vec::new();
        for root in roots {
            let mut s = root;
            for a in &path.attrs {
                s.push('.');
                s.push_str(a);
            }
            if !out.contains(&s) {
                out.push(s);
            }
            if out.len() >= MAX_RESOLVED {
                break;
            }
        }
        out
    }
}

/// The walk over one parsed cell.
#[derive(Default)]
pub(super) struct Walk {
    pub(super) depth: usize,
    pub(super) too_deep: bool,
    pub(super) imports: Vec<String>,
    pub(super) stars: Vec<String>,
    pub(super) bindings: Vec<(String, Path)>,
    /// Names bound to something that is not a path (`s = "text"`, `def s():`).
    pub(super) rebound: Vec<String>,
    pub(super) refs: Vec<Ref>,
}

pub(super) fn string_of(e: &Expr) -> Option<String> {
    match e {
        Expr::Constant(c) => match &c.value {
            Constant::Str(s) => Some(s.clone()),
            _ => None,
        },
        _ => None,
    }
}

/// The path an expression spells, if it is one: `a.b.c`, `getattr(a, "b")`,
/// `__import__("m")`, `importlib.import_module("m")`, `f()`, `a.__dict__["b"]`. Walked
/// without recursion into long attribute chains.
pub(super) fn path_of(e: &Expr, budget: usize) -> Option<Path> {
    if budget == 0 {
        return None;
    }
    let mut attrs: Vec<String> = Vec::new();
    let mut cur = e;
    loop {
        match cur {
            Expr::Attribute(a) => {
                attrs.push(a.attr.to_string());
                cur = &a.value;
            }
            Expr::Subscript(s) => {
                // `x.__dict__["name"]` and `vars(x)["name"]`
                let key = string_of(&s.slice)?;
                match &*s.value {
                    Expr::Attribute(a) if a.attr.as_str() == "__dict__" => {
                        attrs.push(key);
                        cur = &a.value;
                    }
                    Expr::Call(c) if is_name(&c.func, "vars") && c.args.len() == 1 => {
                        attrs.push(key);
                        cur = &c.args[0];
                    }
                    _ => return None,
                }
            }
            Expr::Name(n) => {
                attrs.reverse();
                return Some(Path {
                    root: Root::Name(n.id.to_string()),
                    attrs,
                });
            }
            Expr::Call(c) => {
                if is_name(&c.func, "getattr") && c.args.len() >= 2 {
                    attrs.push(string_of(&c.args[1])?);
                    cur = &c.args[0];
                    continue;
                }
                if let Some(module) = c.args.first().and_then(string_of) {
                    if is_name(&c.func, "__import__") {
                        // `__import__("a.b")` returns `a`.
                        let top = module.split('.').next().unwrap_or_default().to_owned();
                        attrs.reverse();
                        return Some(Path {
                            root: Root::Module(top),
                            attrs,
                        });
                    }
                    if dotted(&c.func).as_deref() == Some("importlib.import_module") {
                        attrs.reverse();
                        return Some(Path {
                            root: Root::Module(module),
                            attrs,
                        });
                    }
                }
                if c.args.is_empty() && c.keywords.is_empty() {
                    let inner = path_of(&c.func, budget - 1)?;
                    attrs.reverse();
                    return Some(Path {
                        root: Root::Called(Box::new(inner)),
                        attrs,
                    });
                }
                return None;
            }
            _ => return None,
        }
        if attrs.len() > 64 {
            return None;
        }
    }
}

/// A literal: a constant, an f-string, or a container display of literals.
pub(super) fn is_literal(e: &Expr) -> bool {
    match e {
        Expr::Constant(_) | Expr::JoinedStr(_) => true,
        Expr::List(l) => l.elts.iter().all(is_literal),
        Expr::Tuple(t) => t.elts.iter().all(is_literal),
        Expr::Set(s) => s.elts.iter().all(is_literal),
        Expr::Dict(d) => d.keys.iter().flatten().all(is_literal) && d.values.iter().all(is_literal),
        _ => false,
    }
}

pub(super) fn is_name(e: &Expr, name: &str) -> bool {
    matches!(e, Expr::Name(n) if n.id.as_str() == name)
}

/// `a.b.c` as written, for a plain attribute chain on a name.
pub(super) fn dotted(e: &Expr) -> Option<String> {
    let p = path_of(e, 1)?;
    match p.root {
        Root::Name(n) => Some(
            std::iter::once(n)
                .chain(p.attrs)
                .collect::<Vec<_>>()
                .join("."),
        ),
        _ => None,
    }
}

impl Walk {
    fn bind_target(&mut self, target: &Expr, value: &Expr) {
        match (target, value) {
            (Expr::Name(n), v) => match path_of(v, 4) {
                Some(p) => self.bindings.push((n.id.to_string(), p)),
                // Only a value that cannot be the old one (`o = 3 if c else o` could).
                None if is_literal(v) => self.rebound.push(n.id.to_string()),
                None => {}
            },
            (Expr::Tuple(t), Expr::Tuple(v)) if t.elts.len() == v.elts.len() => {
                for (a, b) in t.elts.iter().zip(&v.elts) {
                    self.bind_target(a, b);
                }
            }
            (Expr::List(t), Expr::List(v)) if t.elts.len() == v.elts.len() => {
                for (a, b) in t.elts.iter().zip(&v.elts) {
                    self.bind_target(a, b);
                }
            }
            _ => {}
        }
    }

    fn import(&mut self, module: String, bound_as: Option<String>, binds: Option<String>) {
        if let Some(name) = bound_as {
            self.bindings.push((
                name,
                Path {
                    root: Root::Module(binds.unwrap_or_else(|| module.clone())),
                    attrs: Vec::new(),
                },
            ));
        }
        self.imports.push(module);
    }

    fn reference(&mut self, e: &Expr, called: bool, strings: Vec<Option<String>>) -> bool {
        match path_of(e, 4) {
            Some(path) => {
                self.refs.push(Ref {
                    path,
                    called,
                    strings,
                });
                true
            }
            None => false,
        }
    }

    /// Visits what a path expression contains besides its names: the arguments of the
    /// calls in it (`getattr(x, "a")`'s `x`), subscripts' values.
    fn visit_path_parts(&mut self, e: Expr) {
        let mut cur = e;
        loop {
            match cur {
                Expr::Attribute(a) => cur = *a.value,
                Expr::Subscript(s) => cur = *s.value,
                Expr::Call(c) => {
                    // `__import__("m").f`: the inner call is classified too.
                    let strings = c.args.iter().map(string_of).collect();
                    self.reference(&c.func, true, strings);
                    for arg in c.args {
                        self.visit_expr(arg);
                    }
                    for kw in c.keywords {
                        self.visit_expr(kw.value);
                    }
                    cur = *c.func;
                    if matches!(cur, Expr::Name(_)) {
                        return;
                    }
                }
                _ => return,
            }
        }
    }
}

impl Visitor for Walk {
    fn visit_stmt(&mut self, node: ast::Stmt) {
        self.depth += 1;
        if self.depth > MAX_NESTING {
            self.too_deep = true;
        } else {
            self.generic_visit_stmt(node);
        }
        self.depth -= 1;
    }

    fn visit_expr(&mut self, node: Expr) {
        self.depth += 1;
        if self.depth > MAX_NESTING {
            self.too_deep = true;
            self.depth -= 1;
            return;
        }
        match node {
            Expr::Call(call) => {
                let strings = call.args.iter().map(string_of).collect();
                let func = *call.func;
                if self.reference(&func, true, strings) {
                    self.visit_path_parts(func);
                } else {
                    self.visit_expr(func);
                }
                for arg in call.args {
                    self.visit_expr(arg);
                }
                for kw in call.keywords {
                    self.visit_expr(kw.value);
                }
            }
            e @ (Expr::Attribute(_) | Expr::Name(_) | Expr::Subscript(_)) => {
                let load = match &e {
                    Expr::Name(n) => n.ctx == ast::ExprContext::Load,
                    Expr::Attribute(a) => a.ctx == ast::ExprContext::Load,
                    _ => true,
                };
                if load && self.reference(&e, false, Vec::new()) {
                    self.visit_path_parts(e);
                } else {
                    self.generic_visit_expr(e);
                }
            }
            Expr::NamedExpr(n) => {
                self.bind_target(&n.target, &n.value);
                self.visit_expr(*n.value);
            }
            other => self.generic_visit_expr(other),
        }
        self.depth -= 1;
    }

    fn visit_stmt_import(&mut self, node: ast::StmtImport) {
        for alias in node.names {
            let module = alias.name.to_string();
            match alias.asname {
                Some(asname) => self.import(module, Some(asname.to_string()), None),
                None => {
                    let top = module.split('.').next().unwrap_or_default().to_owned();
                    self.import(module, Some(top.clone()), Some(top));
                }
            }
        }
    }

    fn visit_stmt_import_from(&mut self, node: ast::StmtImportFrom) {
        let relative = node.level.is_some_and(|l| l.to_u32() > 0);
        let Some(module) = node.module.map(|m| m.to_string()) else {
            return;
        };
        if relative {
            return;
        }
        self.imports.push(module.clone());
        for alias in node.names {
            let name = alias.name.to_string();
            if name == "*" {
                self.stars.push(module.clone());
                continue;
            }
            let full = format!("{module}.{name}");
            // Importing a function by name is a use of it.
            self.refs.push(Ref {
                path: Path {
                    root: Root::Module(full.clone()),
                    attrs: Vec::new(),
                },
                called: false,
                strings: Vec::new(),
            });
            let bound = alias.asname.map_or(name, |a| a.to_string());
            self.import(full.clone(), Some(bound), Some(full));
        }
    }

    fn visit_stmt_assign(&mut self, node: ast::StmtAssign) {
        for t in &node.targets {
            self.bind_target(t, &node.value);
        }
        self.generic_visit_stmt_assign(node);
    }

    fn visit_stmt_ann_assign(&mut self, node: ast::StmtAnnAssign) {
        if let Some(v) = &node.value {
            self.bind_target(&node.target, v);
        }
        self.generic_visit_stmt_ann_assign(node);
    }

    fn visit_stmt_function_def(&mut self, node: ast::StmtFunctionDef) {
        self.rebound.push(node.name.to_string());
        self.generic_visit_stmt_function_def(node);
    }

    fn visit_stmt_class_def(&mut self, node: ast::StmtClassDef) {
        self.rebound.push(node.name.to_string());
        self.generic_visit_stmt_class_def(node);
    }

    fn visit_arguments(&mut self, node: ast::Arguments) {
        // `def f(run=os.system)`: the parameter is an alias inside the function.
        for a in node
            .posonlyargs
            .iter()
            .chain(&node.args)
            .chain(&node.kwonlyargs)
        {
            if let Some(default) = &a.default {
                if let Some(p) = path_of(default, 4) {
                    self.bindings.push((a.def.arg.to_string(), p));
                }
            }
        }
        self.generic_visit_arguments(node);
    }
}
