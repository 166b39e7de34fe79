//! The allowlist: requirement specifiers, one a line, that say which packages kernels may
//! install (docs/packages.md).

use std::path::Path;

/// One allowed requirement: `seaborn`, `scikit-learn==1.5.2`, `tqdm>=4`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The project name, normalized ([`normalize`]).
    pub name: String,
    /// The line as written (without comment and surrounding blanks).
    pub requirement: String,
}

/// A project name as PEP 503 compares them: lowercase, runs of `-`, `_` and `.` become `-`.
pub fn normalize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut in_run = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !in_run {
                out.push('-');
            }
            in_run = true;
        } else {
            out.extend(c.to_lowercase());
            in_run = false;
        }
    }
    out
}

/// Parses one requirement: a project name, optional extras in brackets, then an optional
/// version specifier (`==`, `>=`, `<=`, `~=`, `!=`, `<`, `>`, comma-separated) and an
/// optional environment marker after `;`. URLs, paths and pip options are refused.
pub fn parse_requirement(line: &str) -> Result<Entry, String> {
    let requirement = line.trim();
    if requirement.is_empty() {
        return Err("empty requirement".to_owned());
    }
    if requirement.starts_with('-') {
        return Err(format!(
            "{requirement:?}: pip options are not allowed here; list package names (with an optional version specifier), one a line"
        ));
    }
    if requirement.contains("://") || requirement.contains(" @ ") || requirement.contains('/') {
        return Err(format!(
            "{requirement:?}: URLs and paths are not allowed; list package names from the package index or --find-links"
        ));
    }
    let end = requirement
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
        .unwrap_or(requirement.len());
    let name = &requirement[..end];
    let valid_ends = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
    };
    if name.is_empty() || !valid_ends(name) {
        return Err(format!(
            "{requirement:?}: does not start with a package name (letters, digits, '-', '_', '.')"
        ));
    }
    let rest = requirement[end..].trim_start();
    let rest = match rest.strip_prefix('[') {
        Some(extras) => match extras.find(']') {
            Some(close) => extras[close + 1..].trim_start(),
            None => return Err(format!("{requirement:?}: unclosed '[' of extras")),
        },
        None => rest,
    };
    let spec = rest.split(';').next().unwrap_or_default().trim();
    if !spec.is_empty() {
        for clause in spec.split(',') {
            let clause = clause.trim();
            let op_len = ["===", "==", ">=", "<=", "~=", "!=", "<", ">"]
                .iter()
                .find(|op| clause.starts_with(**op))
                .map(|op| op.len());
            let Some(op_len) = op_len else {
                return Err(format!(
                    "{requirement:?}: {clause:?} is not a version specifier (like ==1.2 or >=1.0)"
                ));
            };
            let version = clause[op_len..].trim();
            if version.is_empty()
                || !version.chars().all(|c| {
                    c.is_ascii_alphanumeric() || matches!(c, '.' | '*' | '+' | '!' | '-' | '_')
                })
            {
                return Err(format!("{requirement:?}: {clause:?} has no valid version"));
            }
        }
    }
    Ok(Entry {
        name: normalize(name),
        requirement: requirement.to_owned(),
    })
}

/// Parses an allowlist: one requirement a line; `#` starts a comment; blank lines are
/// skipped. A name listed twice is an error (which line should win?).
pub fn parse(text: &str) -> Result<Vec<Entry>, String> {
    let mut entries: Vec<Entry> = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let entry = parse_requirement(line).map_err(|e| format!("line {}: {e}", number + 1))?;
        if let Some(earlier) = entries.iter().find(|e| e.name == entry.name) {
            return Err(format!(
                "line {}: {} is listed twice (also as {:?}); keep one line per package",
                number + 1,
                entry.name,
                earlier.requirement
            ));
        }
        entries.push(entry);
    }
    Ok(entries)
}

/// Reads and parses an allowlist file; the error names the file.
pub fn read(path: &Path) -> Result<Vec<Entry>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the package allowlist {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("package allowlist {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_compared_as_pep_503_says() {
        assert_eq!(normalize("Scikit_Learn"), "scikit-learn");
        assert_eq!(normalize("zope.interface"), "zope-interface");
        assert_eq!(normalize("a-_.b"), "a-b");
    }

    #[test]
    fn an_allowlist_reads_names_specifiers_and_comments() {
        let entries = parse("# analysis\nseaborn\n\nScikit_Learn==1.5.2  # pinned\ntqdm >= 4, <5\nrequests[socks]>=2 ; python_version >= '3.8'\n").expect("parsed");
        let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["seaborn", "scikit-learn", "tqdm", "requests"]);
        assert_eq!(entries[1].requirement, "Scikit_Learn==1.5.2");
    }

    #[test]
    fn urls_options_and_duplicates_are_refused_with_the_line() {
        for (text, needle) in [
            ("seaborn\n-r other.txt\n", "line 2"),
            ("https://example.invalid/x.whl\n", "URLs"),
            ("pkg @ file:///tmp/x\n", "URLs"),
            ("seaborn\nSeaborn==1\n", "listed twice"),
            ("numpy=1\n", "not a version specifier"),
            ("==1.0\n", "package name"),
        ] {
            let err = parse(text).expect_err("refused");
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }
}
