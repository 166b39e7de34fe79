//! IPython's special syntax turned into the Python IPython itself runs, so the scanner
//! reads what the kernel will execute.
//!
//! IPython (`IPython/core/inputtransformer2.py`, "TransformerManager") strips prompts and
//! leading indentation, turns a first line `%%name` into `run_cell_magic`, then finds, one
//! logical line at a time, `!cmd` / `!!cmd`, `%magic`, `x = !cmd`, `x = %magic`, `obj?`
//! and the autocall escapes `/f a`, `,f a`, `;f a`, each at the start of a logical line
//! (never inside a string or a bracket). A single-line cell is then prefiltered: a magic's
//! bare name at its start runs that magic (automagic). The calls this module writes
//! (`get_ipython().system(...)` and so on) are the ones IPython writes, so the scanner
//! judges the literal syntax and an explicit `get_ipython()` call the same way.
//!
//! Where this module and IPython could disagree, it transforms more, never less: a line it
//! leaves alone but IPython would transform would reach the parser as invalid Python.

/// A cell as IPython would hand it to Python's compiler.
pub fn transform_cell(cell: &str) -> String {
    let mut text = cell.to_owned();
    if !text.ends_with('\n') {
        text.push('\n');
    }
    let mut lines: Vec<String> = text.split_inclusive('\n').map(str::to_owned).collect();
    while lines.first().is_some_and(|l| l.trim().is_empty()) {
        lines.remove(0);
    }
    let lines = strip_prompts(leading_indent(lines));
    if let Some(magic) = cell_magic(&lines) {
        return magic;
    }
    let lines = token_transforms(lines);
    lines.concat()
}

/// What a single-line cell's automagic would run: the magic's name and its arguments,
/// when the line starts with the bare name of a magic in `names`.
pub fn automagic<'a>(transformed: &'a str, names: &[&str]) -> Option<(&'a str, &'a str)> {
    let line = transformed.trim_end_matches(['\n', '\r']);
    if line.contains('\n') {
        return None;
    }
    let (ifun, rest) = split_ifun(line)?;
    let rest_trim = rest.trim_start();
    // IPython's assignment checker: `ls = 3`, `ls, x = ...` stay Python.
    if rest_trim.starts_with('=') || rest_trim.starts_with(',') {
        return None;
    }
    names.contains(&ifun).then_some((ifun, rest_trim))
}

/// The leading identifier-ish word (IPython's `ifun`: `[\w*.]+`) and the rest of a line.
pub fn split_ifun(line: &str) -> Option<(&str, &str)> {
    let body = line.trim_start();
    let end = body
        .char_indices()
        .find(|(_, c)| !(c.is_alphanumeric() || *c == '_' || *c == '.' || *c == '*'))
        .map_or(body.len(), |(i, _)| i);
    if end == 0 {
        return None;
    }
    Some((&body[..end], &body[end..]))
}

/// A Python string literal whose value is `s`.
pub fn py_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// IPython's `leading_indent`: the first line's indentation is removed from every line
/// that has it.
fn leading_indent(lines: Vec<String>) -> Vec<String> {
    let Some(first) = lines.first() else {
        return lines;
    };
    let n = first.len() - first.trim_start_matches([' ', '\t']).len();
    if n == 0 {
        return lines;
    }
    let space = first[..n].to_owned();
    lines
        .into_iter()
        .map(|l| match l.strip_prefix(&space) {
            Some(rest) => rest.to_owned(),
            None => l,
        })
        .collect()
}

/// IPython's prompt strippers: `>>> ` / `... ` (classic) and `In [1]: ` / `   ...: `.
fn strip_prompts(lines: Vec<String>) -> Vec<String> {
    fn classic(l: &str, continuation: bool) -> Option<&str> {
        let rest = l
            .strip_prefix(">>>")
            .or_else(|| continuation.then(|| l.strip_prefix("...")).flatten())?;
        match rest.strip_prefix(' ') {
            Some(r) => Some(r),
            None if rest.trim_end_matches(['\n', '\r']).is_empty() => Some(rest),
            None => None,
        }
    }
    fn ipython(l: &str) -> Option<&str> {
        if let Some(rest) = l.strip_prefix("In [") {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits > 0 {
                return rest[digits..].strip_prefix("]: ");
            }
        }
        let t = l.trim_start();
        let dots = t.bytes().take_while(|b| *b == b'.').count();
        if dots >= 3 {
            let r = t[dots..].strip_prefix(':')?;
            return Some(r.strip_prefix(' ').unwrap_or(r));
        }
        None
    }
    let strip_with = |f: &dyn Fn(&str) -> Option<&str>, lines: &[String]| -> Vec<String> {
        lines
            .iter()
            .map(|l| f(l).map_or_else(|| l.clone(), str::to_owned))
            .collect()
    };
    let classic_found = lines.first().is_some_and(|l| classic(l, false).is_some())
        || lines.get(1).is_some_and(|l| classic(l, true).is_some());
    let lines = if classic_found {
        strip_with(&|l| classic(l, true), &lines)
    } else {
        lines
    };
    let ipython_found = lines.first().is_some_and(|l| ipython(l).is_some())
        || lines.get(1).is_some_and(|l| ipython(l).is_some());
    if ipython_found {
        strip_with(&ipython, &lines)
    } else {
        lines
    }
}

/// `%%name args` on the first line: the whole cell is the magic's.
fn cell_magic(lines: &[String]) -> Option<String> {
    let first = lines.first()?;
    let head = first.strip_prefix("%%")?;
    let head = head.trim_end_matches(['\n', '\r']);
    if let Some((name, _)) = split_ifun(head) {
        if head[name.len()..].starts_with('?') {
            return None; // `%%bash?` is help
        }
    }
    let (name, args) = head.split_once(' ').unwrap_or((head, ""));
    let body: String = lines[1..].concat();
    Some(format!(
        "get_ipython().run_cell_magic({}, {}, {})\n",
        py_str(name),
        py_str(args),
        py_str(&body)
    ))
}

/// Finds and rewrites IPython's line syntax, top to bottom. After each rewrite the scan
/// resumes at the rewritten line: what follows is re-read as IPython re-tokenises it.
fn token_transforms(mut lines: Vec<String>) -> Vec<String> {
    let mut from = 0;
    while let Some(found) = next_special(&lines, from) {
        let (start, replaced_to, new_line) = rewrite(&lines, &found);
        lines.splice(start..=replaced_to, std::iter::once(new_line));
        from = start + 1;
    }
    lines
}

#[derive(Debug)]
enum Special {
    /// `!cmd`, `%magic`, `?obj`, `/f a`, `,f a`, `;f a` at (line, col).
    Escaped { line: usize, col: usize },
    /// `x = %magic` / `x = !cmd`: the escape at (line, col).
    Assigned { line: usize, col: usize },
    /// `obj?` ending the logical line that starts at (line, col) and ends on `last`.
    Help {
        line: usize,
        col: usize,
        last: usize,
    },
}

/// One logical line: where it starts, where it ends, its characters outside strings and
/// comments (a string counts as one `"`), with their positions.
struct Logical {
    line: usize,
    col: usize,
    last: usize,
    code: Vec<(usize, usize, char)>,
}

fn next_special(lines: &[String], from: usize) -> Option<Special> {
    let mut l = from;
    while l < lines.len() {
        let text = &lines[l];
        let col = text.len() - text.trim_start_matches([' ', '\t', '\x0c']).len();
        let rest = &text[col..];
        if rest.trim().is_empty() || rest.starts_with('#') {
            l += 1;
            continue;
        }
        if escape_len(rest) > 0 {
            let last = continued_end(lines, l);
            if help_target(&assemble(lines, l, col, last)).is_some() {
                return Some(Special::Help { line: l, col, last });
            }
            return Some(Special::Escaped { line: l, col });
        }
        let logical = read_logical(lines, l, col);
        if logical.code.last().is_some_and(|(_, _, c)| *c == '?') {
            let content = assemble_span(lines, l, col, logical.last);
            if help_target(&content).is_some() {
                return Some(Special::Help {
                    line: l,
                    col,
                    last: logical.last,
                });
            }
        }
        if let Some((line, col)) = assignment_escape(&logical, lines) {
            return Some(Special::Assigned { line, col });
        }
        let _ = (logical.line, logical.col);
        l = logical.last + 1;
    }
    None
}

/// Length of the escape that starts `rest` (0 if none): `!!`, `??` or one of `! ? % , ; /`
/// standing as a token of its own (not `!=`, `%=`, `/=`, `//`).
fn escape_len(rest: &str) -> usize {
    let mut chars = rest.chars();
    let (Some(a), b) = (chars.next(), chars.next()) else {
        return 0;
    };
    match (a, b) {
        ('!', Some('!')) | ('?', Some('?')) => 2,
        ('!' | '%' | '/', Some('=')) => 0,
        ('/', Some('/')) => 0,
        ('!' | '?' | '%' | ',' | ';' | '/', _) => 1,
        _ => 0,
    }
}

/// IPython's `find_end_of_continued_line`: the last physical line joined by backslashes.
fn continued_end(lines: &[String], start: usize) -> usize {
    let mut end = start;
    while end + 1 < lines.len() && lines[end].trim_end_matches(['\n', '\r']).ends_with('\\') {
        end += 1;
    }
    end
}

/// IPython's `assemble_continued_line`: the pieces from (line, col) to `last`, joined with
/// spaces where the backslashes were.
fn assemble(lines: &[String], line: usize, col: usize, last: usize) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for (i, l) in lines[line..=last].iter().enumerate() {
        let piece = if i == 0 { &l[col..] } else { l.as_str() };
        let piece = piece.trim_end_matches(['\n', '\r']);
        let piece = if line + i < last {
            piece.strip_suffix('\\').unwrap_or(piece)
        } else {
            piece
        };
        parts.push(piece);
    }
    parts.join(" ")
}

/// The text from (line, col) through line `last`, newlines kept but the last.
fn assemble_span(lines: &[String], line: usize, col: usize, last: usize) -> String {
    let mut s = lines[line][col..].to_owned();
    for l in &lines[line + 1..=last] {
        s.push_str(l);
    }
    s.trim_end_matches(['\n', '\r']).to_owned()
}

/// IPython's help regex (`%{0,2}name(.name)*` then `?` or `??` at the end), searched.
fn help_target(content: &str) -> Option<String> {
    let t = content.trim_end();
    let t = t.strip_suffix('?')?;
    let t = t.strip_suffix('?').unwrap_or(t);
    let is_word = |c: char| c.is_alphanumeric() || c == '_' || c == '*';
    let start = t
        .char_indices()
        .rev()
        .find(|(_, c)| !(is_word(*c) || *c == '.' || *c == '%'))
        .map_or(0, |(i, c)| i + c.len_utf8());
    let target = &t[start..];
    let name = target.trim_start_matches('%');
    if target.len() - name.len() > 2 || name.is_empty() {
        return None;
    }
    let ok = name.split('.').all(|part| {
        part.chars()
            .next()
            .is_some_and(|c| c.is_alphabetic() || c == '_' || c == '*')
            && part.chars().all(is_word)
    });
    ok.then(|| target.to_owned())
}

/// Reads the logical line that starts at (line, col), as Python's tokenizer splits them:
/// strings (any prefix, single or triple quoted), brackets, comments and backslash
/// continuations.
fn read_logical(lines: &[String], line: usize, col: usize) -> Logical {
    let mut code = Vec::new();
    let mut depth = 0usize;
    let mut quote: Option<(char, bool)> = None;
    let mut l = line;
    let mut start = col;
    loop {
        let text = &lines[l];
        let bytes: Vec<(usize, char)> = text[start..]
            .char_indices()
            .map(|(i, c)| (i + start, c))
            .collect();
        let mut i = 0;
        let mut continued = false;
        while i < bytes.len() {
            let (pos, c) = bytes[i];
            if let Some((q, triple)) = quote {
                if c == '\\' {
                    i += 2;
                    continue;
                }
                if c == q {
                    if !triple {
                        quote = None;
                    } else if bytes.get(i + 1).is_some_and(|x| x.1 == q)
                        && bytes.get(i + 2).is_some_and(|x| x.1 == q)
                    {
                        quote = None;
                        i += 3;
                        continue;
                    }
                } else if (c == '\n' || c == '\r') && !triple {
                    quote = None; // unterminated: the tokenizer gives up on it here
                }
                i += 1;
                continue;
            }
            match c {
                '#' => break,
                '\'' | '"' => {
                    let triple = bytes.get(i + 1).is_some_and(|x| x.1 == c)
                        && bytes.get(i + 2).is_some_and(|x| x.1 == c);
                    quote = Some((c, triple));
                    code.push((l, pos, '"'));
                    i += if triple { 3 } else { 1 };
                    continue;
                }
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' => depth = depth.saturating_sub(1),
                '\\' if bytes.get(i + 1).is_none_or(|x| x.1 == '\n' || x.1 == '\r') => {
                    continued = true;
                }
                _ => {}
            }
            if !c.is_whitespace() && c != '\\' {
                code.push((l, pos, c));
            }
            i += 1;
        }
        let open = quote.is_some_and(|(_, triple)| triple) || depth > 0 || continued;
        if !open || l + 1 >= lines.len() {
            return Logical {
                line,
                col,
                last: l,
                code,
            };
        }
        l += 1;
        start = 0;
    }
}

/// `x = %magic` / `x = !cmd`: the first lone `=` outside brackets, then the escape.
fn assignment_escape(logical: &Logical, lines: &[String]) -> Option<(usize, usize)> {
    let code = &logical.code;
    let mut depth = 0usize;
    for (k, &(l, pos, c)) in code.iter().enumerate() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            '=' if depth == 0 => {
                let prev = k.checked_sub(1).map(|p| code[p]);
                let next = code.get(k + 1);
                let glued = |x: Option<&(usize, usize, char)>, at: usize| {
                    x.is_some_and(|(xl, xp, _)| *xl == l && *xp == at)
                };
                let prev_op = prev.is_some_and(|(pl, pp, pc)| {
                    pl == l && pp + pc.len_utf8() == pos && "=<>!+-*/%&|^@:".contains(pc)
                });
                if prev_op || (glued(next, pos + 1) && next.is_some_and(|n| n.2 == '=')) {
                    return None; // ==, <=, +=, := ...: not an assignment
                }
                let (nl, np, nc) = *next?;
                let after = &lines[nl][np..];
                return match nc {
                    '%' if after[1..].starts_with(|ch: char| ch.is_alphabetic() || ch == '_') => {
                        Some((nl, np))
                    }
                    '!' if !after[1..].starts_with('=') => Some((nl, np)),
                    _ => None,
                };
            }
            _ => {}
        }
    }
    None
}

/// The rewrite of one special line: (first line, last line replaced, the new line).
fn rewrite(lines: &[String], found: &Special) -> (usize, usize, String) {
    match *found {
        Special::Help { line, col, last } => {
            let content = assemble_span(lines, line, col, last);
            let target = help_target(&content).unwrap_or_default();
            let call = format!(
                "get_ipython().run_line_magic('pinfo', {})",
                py_str(target.trim_start_matches('%'))
            );
            (line, last, format!("{}{call}\n", &lines[line][..col]))
        }
        Special::Escaped { line, col } => {
            let last = continued_end(lines, line);
            let text = assemble(lines, line, col, last);
            let n = escape_len(&text);
            let (escape, content) = text.split_at(n);
            let call = escaped_call(escape, content);
            (line, last, format!("{}{call}\n", &lines[line][..col]))
        }
        Special::Assigned { line, col } => {
            let last = continued_end(lines, line);
            let text = assemble(lines, line, col, last);
            let call = if let Some(cmd) = text.strip_prefix('!') {
                format!("get_ipython().getoutput({})", py_str(cmd))
            } else {
                let (name, args) = text[1..].split_once(' ').unwrap_or((&text[1..], ""));
                format!(
                    "get_ipython().run_line_magic({}, {})",
                    py_str(name),
                    py_str(args)
                )
            };
            (line, last, format!("{}{call}\n", &lines[line][..col]))
        }
    }
}

/// IPython's `tr` table for an escaped line.
fn escaped_call(escape: &str, content: &str) -> String {
    let (name, args) = content.split_once(' ').unwrap_or((content, ""));
    match escape {
        "!" => format!("get_ipython().system({})", py_str(content)),
        "!!" => format!("get_ipython().getoutput({})", py_str(content)),
        "?" | "??" => format!("get_ipython().run_line_magic('pinfo', {})", py_str(content)),
        "%" => format!(
            "get_ipython().run_line_magic({}, {})",
            py_str(name),
            py_str(args)
        ),
        "," => {
            let quoted: Vec<String> = args.split_whitespace().map(py_str).collect();
            format!("{name}({})", quoted.join(", "))
        }
        ";" => format!("{name}({})", py_str(args)),
        _ => format!(
            "{name}({})",
            args.split_whitespace().collect::<Vec<_>>().join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_and_magic_lines_become_calls() {
        assert_eq!(
            transform_cell("!ls -l\nx = 1"),
            "get_ipython().system('ls -l')\nx = 1\n"
        );
        assert_eq!(
            transform_cell("if x:\n    !!ls\n"),
            "if x:\n    get_ipython().getoutput('ls')\n"
        );
        assert_eq!(
            transform_cell("files = !ls *.csv"),
            "files = get_ipython().getoutput('ls *.csv')\n"
        );
        assert_eq!(
            transform_cell("t = %time f(1)"),
            "t = get_ipython().run_line_magic('time', 'f(1)')\n"
        );
        assert_eq!(
            transform_cell("%system echo 'a'"),
            "get_ipython().run_line_magic('system', 'echo \\'a\\'')\n"
        );
        assert_eq!(
            transform_cell("%%bash\nls /\n"),
            "get_ipython().run_cell_magic('bash', '', 'ls /\\n')\n"
        );
    }

    #[test]
    fn autocall_escapes_become_calls() {
        assert_eq!(transform_cell("/f a b"), "f(a, b)\n");
        assert_eq!(transform_cell(",f a b"), "f('a', 'b')\n");
        assert_eq!(transform_cell(";f a b"), "f('a b')\n");
    }

    #[test]
    fn strings_comments_and_operators_are_left_alone() {
        for cell in [
            "s = '''\n!rm x\n%system y\n'''\n",
            "x = (1,\n  !2)\n",
            "# !ls\n",
            "a != b\n",
            "a %= 3\n",
            "x == !y\n",
            "x //= 2\n",
        ] {
            let t = transform_cell(cell);
            assert!(!t.contains("get_ipython"), "{cell:?} became {t:?}");
        }
    }

    #[test]
    fn help_is_not_a_call_and_a_rewrite_rereads_what_follows() {
        assert_eq!(
            transform_cell("os.system?"),
            "get_ipython().run_line_magic('pinfo', 'os.system')\n"
        );
        assert_eq!(
            transform_cell("!echo \"\"\"\n!rm x\n"),
            "get_ipython().system('echo \"\"\"')\nget_ipython().system('rm x')\n"
        );
    }

    #[test]
    fn prompts_and_indentation_are_stripped() {
        assert_eq!(
            transform_cell(">>> import os\n>>> !ls"),
            "import os\nget_ipython().system('ls')\n"
        );
        assert_eq!(
            transform_cell("In [3]: !ls\n"),
            "get_ipython().system('ls')\n"
        );
        assert_eq!(
            transform_cell("    !ls\n    x = 1"),
            "get_ipython().system('ls')\nx = 1\n"
        );
        assert_eq!(
            transform_cell("\n\n%%sh\nid"),
            "get_ipython().run_cell_magic('sh', '', 'id\\n')\n"
        );
    }

    #[test]
    fn automagic_reads_a_bare_magic_name_on_a_single_line() {
        let names = ["system", "ls"];
        assert_eq!(automagic("ls -la\n", &names), Some(("ls", "-la")));
        assert_eq!(
            automagic("system(\"id\")\n", &names),
            Some(("system", "(\"id\")"))
        );
        assert_eq!(automagic("ls = 3\n", &names), None);
        assert_eq!(automagic("ls\nx\n", &names), None);
        assert_eq!(automagic("lsx -l\n", &names), None);
    }

    #[test]
    fn literals_round_trip_control_characters() {
        assert_eq!(py_str("a'b\\c\n\x01"), "'a\\'b\\\\c\\n\\x01'");
    }
}
