//! The execution policy (docs/policy.md): rules that deny an execution, or hold it for a
//! person, by what its code does: the modules it imports, the dotted names it calls or
//! refers to, and the shell commands it runs through IPython.
//!
//! No I/O: a policy file's text in, a [`Decision`] per cell out. The cell is read as IPython
//! reads it ([`ipython`]) and parsed by a real Python parser ([`scan`]).
//!
//! The scanner reads untrusted code. Cells over [`MAX_CODE_BYTES`] or nested deeper than
//! [`scan::MAX_NESTING`] are denied whatever the rules say (a cell the scanner cannot read
//! would otherwise be a way around them). Walking and dropping a syntax tree recurses, so
//! callers run [`Policy::check_in`] on a thread with [`STACK_BYTES`] of stack.

pub mod ipython;
pub mod scan;

pub use scan::{Findings, Scope};
use serde::Deserialize;

/// The largest cell (code and user expressions together) the scanner reads.
pub const MAX_CODE_BYTES: usize = 512 * 1024;
/// Stack enough to walk and drop the deepest tree a cell within [`MAX_CODE_BYTES`] parses to.
pub const STACK_BYTES: usize = 256 * 1024 * 1024;

/// What to do with an execution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow,
    /// Never sent to the kernel.
    Deny(Verdict),
    /// Held until a person answers.
    Ask(Verdict),
}

/// Which rule decided, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The rule's number in the file, from 1; 0 when the scanner itself decided (code that
    /// does not parse under `on_parse_error = "deny"`, or code too large to read).
    pub rule: usize,
    /// The rule's reason, as the user reads it.
    pub reason: String,
    /// What matched: `import subprocess`, `call os.system`, `shell escape !ls`.
    pub matched: String,
}

/// A policy file that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{0}")]
    Syntax(String),
    #[error("rule {rule}: {problem}")]
    Rule { rule: usize, problem: String },
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnParseError {
    #[default]
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Deny,
    Ask,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    on_parse_error: OnParseError,
    #[serde(default, rename = "rule")]
    rules: Vec<Rule>,
}

/// One `[[rule]]` of the policy file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub action: Action,
    pub reason: String,
    /// Modules; each also matches its submodules.
    #[serde(default)]
    pub imports: Vec<String>,
    /// Dotted names, matched when called or referred to (passing `os.system` to `map`
    /// runs it as surely as calling it).
    #[serde(default)]
    pub calls: Vec<String>,
    /// IPython's shell escapes and shell magics.
    #[serde(default)]
    pub shell: bool,
}

/// A parsed policy file.
#[derive(Debug, Clone)]
pub struct Policy {
    on_parse_error: OnParseError,
    rules: Vec<Rule>,
    installable: Option<Installable>,
}

/// Says whether a package (normalized name) is on the gateway's allowlist: `%pip install`
/// of such packages only is no shell command.
#[derive(Clone)]
pub struct Installable(pub std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>);

impl std::fmt::Debug for Installable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Installable")
    }
}

impl Policy {
    /// Reads a policy file; errors name the rule and what is wrong with it.
    pub fn from_toml(text: &str) -> Result<Policy, PolicyError> {
        let file: PolicyFile =
            toml::from_str(text).map_err(|e| PolicyError::Syntax(e.to_string()))?;
        for (i, rule) in file.rules.iter().enumerate() {
            let bad = |problem: String| PolicyError::Rule {
                rule: i + 1,
                problem,
            };
            if rule.reason.trim().is_empty() {
                return Err(bad("`reason` is empty: say why, users read it".into()));
            }
            if rule.imports.is_empty() && rule.calls.is_empty() && !rule.shell {
                return Err(bad(
                    "matches nothing: give `imports`, `calls` or `shell = true`".into(),
                ));
            }
            for name in rule.imports.iter().chain(&rule.calls) {
                if !is_dotted(name) {
                    return Err(bad(format!(
                        "{name:?} is not a dotted Python name (like os.system)"
                    )));
                }
            }
        }
        Ok(Policy {
            on_parse_error: file.on_parse_error,
            rules: file.rules,
            installable: None,
        })
    }

    /// Lets `%pip install` of packages `installable` accepts pass as no shell command.
    pub fn with_installable(mut self, installable: Installable) -> Self {
        self.installable = Some(installable);
        self
    }

    /// How many rules it has.
    pub fn rules(&self) -> usize {
        self.rules.len()
    }

    /// The decision for a cell and its user expressions, with no earlier cells known.
    pub fn check<'a>(
        &self,
        code: &str,
        expressions: impl IntoIterator<Item = &'a str>,
    ) -> Decision {
        self.check_in(&mut Scope::default(), code, expressions)
    }

    /// The decision for a cell and its user expressions; `scope` holds the aliases the
    /// kernel's earlier cells bound and takes this cell's.
    pub fn check_in<'a>(
        &self,
        scope: &mut Scope,
        code: &str,
        expressions: impl IntoIterator<Item = &'a str>,
    ) -> Decision {
        let expressions: Vec<&str> = expressions.into_iter().collect();
        let size = code.len() + expressions.iter().map(|e| e.len()).sum::<usize>();
        self.check_sized(scope, code, &expressions, size)
    }

    /// The decision for a shell command run outside the kernel (a sandbox's command, as
    /// E2B's `commands.run` sends it): every rule with `shell = true` matches it, the first
    /// that denies decides, else the first that asks. Imports and calls do not apply.
    pub fn check_command(&self, command: &str) -> Decision {
        let command = command.trim();
        let mut shown: String = command.chars().take(80).collect();
        if shown.len() < command.len() {
            shown.push('…');
        }
        let mut ask = None;
        for (i, rule) in self.rules.iter().enumerate().filter(|(_, r)| r.shell) {
            let verdict = Verdict {
                rule: i + 1,
                reason: rule.reason.clone(),
                matched: format!("shell command {shown}"),
            };
            match rule.action {
                Action::Deny => return Decision::Deny(verdict),
                Action::Ask => {
                    ask.get_or_insert(verdict);
                }
            }
        }
        ask.map_or(Decision::Allow, Decision::Ask)
    }

    fn check_sized(
        &self,
        scope: &mut Scope,
        code: &str,
        expressions: &[&str],
        size: usize,
    ) -> Decision {
        if size > MAX_CODE_BYTES {
            return Decision::Deny(Verdict {
                rule: 0,
                reason: format!(
                    "the code is too large for the execution policy to check ({size} bytes, at most {MAX_CODE_BYTES}); split the cell, or upload data as a file"
                ),
                matched: "size limit".into(),
            });
        }
        // What the cell binds is remembered only if it may run: a denied cell binds nothing.
        let mut after = scope.clone();
        let decision = self.decide(&mut after, code, expressions);
        if !matches!(decision, Decision::Deny(_)) {
            *scope = after;
        }
        decision
    }

    fn decide(&self, scope: &mut Scope, code: &str, expressions: &[&str]) -> Decision {
        let mut findings = scan::cell(code, scope);
        for e in expressions {
            let f = scan::python(e, scope);
            findings.imports.extend(f.imports);
            findings.names.extend(f.names);
            findings.shell.extend(f.shell);
            findings.installs.extend(f.installs);
            if findings.limit.is_none() {
                findings.limit = f.limit;
            }
        }
        for (shown, names) in std::mem::take(&mut findings.installs) {
            let allowed = self
                .installable
                .as_ref()
                .is_some_and(|f| names.iter().all(|n| (f.0)(n)));
            if !allowed {
                findings.shell.push(shown);
            }
        }
        if findings.limit == Some(scan::Limit::TooDeep) {
            return Decision::Deny(Verdict {
                rule: 0,
                reason: format!(
                    "the code is nested too deeply for the execution policy to check (more than {} levels)",
                    scan::MAX_NESTING
                ),
                matched: "nesting limit".into(),
            });
        }
        let unparsed = matches!(findings.limit, Some(scan::Limit::Parse(_)));
        if unparsed {
            // Code the parser rejects fails in the kernel too, unless the parser lags
            // Python's grammar; the words in it are matched as a backstop.
            words(code, &mut findings);
        }
        let mut ask = None;
        for (i, rule) in self.rules.iter().enumerate() {
            let Some(matched) = rule_matches(rule, &findings) else {
                continue;
            };
            let verdict = Verdict {
                rule: i + 1,
                reason: rule.reason.clone(),
                matched,
            };
            match rule.action {
                Action::Deny => return Decision::Deny(verdict),
                Action::Ask => {
                    ask.get_or_insert(verdict);
                }
            }
        }
        if let Some(verdict) = ask {
            return Decision::Ask(verdict);
        }
        match (unparsed, self.on_parse_error, &findings.limit) {
            (true, OnParseError::Deny, Some(scan::Limit::Parse(e))) => Decision::Deny(Verdict {
                rule: 0,
                reason: format!(
                    "the code does not parse ({e}), and the execution policy denies what it cannot check"
                ),
                matched: "parse error".into(),
            }),
            _ => Decision::Allow,
        }
    }
}

fn is_dotted(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            part.chars()
                .next()
                .is_some_and(|c| c.is_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_alphanumeric() || c == '_')
        })
}

/// What of `findings` a rule matches, as people read it.
fn rule_matches(rule: &Rule, findings: &Findings) -> Option<String> {
    let under = |name: &str, prefix: &str| {
        name == prefix
            || name
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with('.'))
    };
    for m in &findings.imports {
        if rule.imports.iter().any(|r| under(m, r)) {
            return Some(format!("import {m}"));
        }
    }
    for (name, called) in &findings.names {
        if rule.calls.iter().any(|r| under(name, r)) {
            let verb = if *called { "call" } else { "use of" };
            return Some(format!("{verb} {name}"));
        }
    }
    if rule.shell {
        if let Some(s) = findings.shell.first() {
            let mut shown: String = s.chars().take(80).collect();
            if shown.len() < s.len() {
                shown.push('…');
            }
            return Some(format!("shell escape {shown}"));
        }
    }
    None
}

/// The backstop for code that does not parse: every dotted word counts as imported and
/// used, and a line starting with `!` or `%` as a shell escape.
fn words(code: &str, findings: &mut Findings) {
    let mut word = String::new();
    for c in code.chars().chain(std::iter::once(' ')) {
        if c.is_alphanumeric() || c == '_' || c == '.' {
            word.push(c);
        } else if !word.is_empty() {
            let w = word.trim_matches('.').to_owned();
            if !w.is_empty() {
                findings.imports.push(w.clone());
                findings.names.push((w, false));
            }
            word.clear();
        }
    }
    for line in code.lines() {
        let t = line.trim_start();
        if t.starts_with('!') || (t.starts_with('%') && !t.starts_with("%%time")) {
            findings.shell.push(t.chars().take(80).collect());
        }
    }
}

#[cfg(test)]
mod tests;
