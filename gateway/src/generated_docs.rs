//! Tables in `docs/` that are generated from the code (the audit records, the API's
//! operations): a unit test compares each with what the code renders now, and with
//! `KERNELGATE_WRITE_DOCS=1` writes it instead, so a document cannot drift from its source.

/// Checks that `docs/<file>` holds `table` between the line `<!-- <what>: ... -->` and
/// `<!-- end of <what> -->`; writes it there when `KERNELGATE_WRITE_DOCS` is set. `test` is
/// the name of the calling test, for the message that says how to regenerate.
pub fn check(file: &str, what: &str, table: &str, test: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs")
        .join(file);
    let doc = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("docs/{file}: {e}"));
    let begin = format!("<!-- {what}: ");
    let start = doc
        .find(&begin)
        .and_then(|at| doc[at..].find('\n').map(|nl| at + nl + 1))
        .unwrap_or_else(|| panic!("docs/{file} has no line starting {begin:?}"));
    let end = doc
        .find(&format!("<!-- end of {what} -->"))
        .unwrap_or_else(|| panic!("docs/{file} has no end marker for {what}"));
    if std::env::var_os("KERNELGATE_WRITE_DOCS").is_some() {
        let written = format!("{}{table}{}", &doc[..start], &doc[end..]);
        std::fs::write(&path, written).unwrap_or_else(|e| panic!("docs/{file}: {e}"));
        return;
    }
    assert_eq!(
        &doc[start..end],
        table,
        "docs/{file} is out of step with the code: run \
         KERNELGATE_WRITE_DOCS=1 cargo test -p kernelgate --lib {test}"
    );
}
