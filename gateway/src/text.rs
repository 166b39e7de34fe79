//! Small text helpers the gateway's parts share: percent-decoding (URLs, query strings,
//! forms) and one-line summaries of longer text.

/// A URL path's `text` with its `%XX` escapes decoded; `None` for a bad escape or bytes
/// that are not UTF-8.
pub fn percent_decode(text: &str) -> Option<String> {
    String::from_utf8(decode(text, false)?).ok()
}

/// A query string's or form's value: `%XX` escapes decoded, `+` a space. An escape that is
/// not one is kept as written, bytes that are not UTF-8 as U+FFFD: the value a client meant
/// is the best guess.
pub fn form_decode(text: &str) -> String {
    let bytes = decode(text, true).unwrap_or_else(|| text.as_bytes().to_vec());
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `text`'s bytes with escapes decoded (and `+` as a space where `plus_is_space`); a bad
/// escape is kept as written when `plus_is_space` (forms), else `None`.
fn decode(text: &str, plus_is_space: bool) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match (bytes[i], bytes.get(i + 1..i + 3)) {
            (b'%', Some([h, l])) if hex(*h).is_some() && hex(*l).is_some() => {
                out.push((hex(*h)? * 16 + hex(*l)?) as u8);
                i += 3;
                continue;
            }
            (b'%', _) if !plus_is_space => return None,
            (b'+', _) if plus_is_space => out.push(b' '),
            (b, _) => out.push(b),
        }
        i += 1;
    }
    Some(out)
}

/// `text` with every run of white space (line breaks included) as one space.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `text` cut to `max` characters, an ellipsis marking the cut.
pub fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_decode_strictly_and_forms_leniently() {
        assert_eq!(
            percent_decode("/a%20b/c%2Bd+e").as_deref(),
            Some("/a b/c+d+e")
        );
        assert_eq!(percent_decode("100%"), None);
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%ff"), None, "not UTF-8");
        assert_eq!(form_decode("a+b%2Bc"), "a b+c");
        assert_eq!(form_decode("100%"), "100%");
        assert_eq!(form_decode("%zz+x"), "%zz x");
        assert_eq!(form_decode("%C3%A9"), "é");
    }

    #[test]
    fn summaries_fit_one_line() {
        assert_eq!(one_line("  a\n\tb   c \n"), "a b c");
        assert_eq!(cut("héllo", 3), "hél…");
        assert_eq!(cut("hé", 3), "hé");
    }
}
