//! Extractors whose rejections are API errors (`{"reason", "message"}`), not axum's plain
//! text.

use super::error::ApiError;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

/// [`axum::extract::Path`]: a parameter that is not UTF-8 once percent-decoded
/// (`/api/kernels/%FF`) answers 400 with an error body.
#[derive(Debug)]
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(e) => Err(ApiError::new(e.status(), e.body_text())),
        }
    }
}

/// A JSON request body as `T`, or a 400 that says what is wrong in the client's terms: not
/// JSON at all, a field `T` does not have (with `#[serde(deny_unknown_fields)]`, listing the
/// ones it has), a missing field, or a value of the wrong type (naming the field).
/// `example` is a body to copy.
pub fn json_body<T: DeserializeOwned>(body: &[u8], example: &str) -> Result<T, ApiError> {
    let refused = |field: &str, e: &serde_json::Error| {
        ApiError::bad_request(format!(
            "{}; send JSON like {example} with Content-Type: application/json",
            describe(field, e)
        ))
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| refused(&e.path().to_string(), e.inner()))?;
    de.end().map_err(|e| refused("", &e))?;
    Ok(value)
}

/// What a serde_json error means, without its Rust vocabulary.
fn describe(field: &str, e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let text = e.to_string();
    // serde_json appends " at line L column C"; the location is said our way.
    let text = text
        .rsplit_once(" at line ")
        .map_or(text.as_str(), |(head, _)| head);
    match e.classify() {
        Category::Eof if e.line() == 1 && e.column() == 0 => "the body is empty".to_owned(),
        Category::Syntax | Category::Eof | Category::Io => format!(
            "the body is not valid JSON ({text} at line {}, column {})",
            e.line(),
            e.column()
        ),
        Category::Data => {
            let at = match field {
                "" | "." => String::new(),
                f => format!("`{f}`: "),
            };
            if let Some(rest) = text.strip_prefix("unknown field ") {
                // "unknown field `x`, expected one of `a`, `b`" (or "expected `a`").
                let (name, known) = rest.split_once(", expected ").unwrap_or((rest, ""));
                let known = known.strip_prefix("one of ").unwrap_or(known);
                return format!(
                    "unknown field {name} in {}: the fields are {known}",
                    where_(field)
                );
            }
            if let Some(rest) = text.strip_prefix("invalid type: ") {
                let (got, expected) = rest.split_once(", expected ").unwrap_or((rest, ""));
                return format!(
                    "{at}{} expected, got {}",
                    plain_type(expected),
                    got_kind(got)
                );
            }
            // Structs also take arrays (in field order); nobody means that.
            if text.starts_with("invalid length") && text.contains("expected struct") {
                return format!("{at}an object expected, got an array");
            }
            format!("{at}{text}")
        }
    }
}

/// Where an unknown field was met: the body, or an object inside it.
fn where_(path: &str) -> String {
    // The path ends with the unknown field itself.
    match path.rsplit_once('.') {
        Some((parent, _)) if !parent.is_empty() => format!("`{parent}`"),
        _ => "the body".to_owned(),
    }
}

/// serde's name of an expected type, as a JSON user says it.
fn plain_type(expected: &str) -> &str {
    match expected {
        "f64" | "f32" => "a number",
        "u64" | "u32" | "u16" | "u8" | "usize" | "i64" | "i32" | "i16" | "i8" | "isize" => {
            "a whole number"
        }
        "a boolean" => "true or false",
        "a map" => "an object",
        "a sequence" => "an array",
        other if other.starts_with("struct ") => "an object",
        other => other,
    }
}

/// serde's description of the value it got (`string "x"`, `integer `5``), as its JSON kind.
fn got_kind(got: &str) -> &'static str {
    match got.split([' ', '`']).next().unwrap_or("") {
        "string" => "a string",
        "integer" | "floating" => "a number",
        "boolean" => "true or false",
        "null" | "unit" => "null",
        "map" => "an object",
        "sequence" => "an array",
        _ => "something else",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        code: String,
        #[serde(default)]
        timeout: Option<f64>,
        #[serde(default)]
        flag: bool,
    }

    fn message(body: &str) -> String {
        json_body::<Body>(body.as_bytes(), "{\"code\": \"1\"}")
            .expect_err("refused")
            .message
    }

    #[test]
    fn errors_name_the_field_in_json_terms() {
        assert!(json_body::<Body>(br#"{"code": "1", "timeout": 5}"#, "").is_ok());
        assert_eq!(
            message(r#"{"code": "1", "timout": 5}"#),
            "unknown field `timout` in the body: the fields are `code`, `timeout`, `flag`; \
             send JSON like {\"code\": \"1\"} with Content-Type: application/json"
        );
        assert!(message(r#"{"timeout": 5}"#).starts_with("missing field `code`;"));
        assert!(
            message(r#"{"code": "1", "timeout": "5"}"#)
                .starts_with("`timeout`: a number expected, got a string;"),
            "{}",
            message(r#"{"code": "1", "timeout": "5"}"#)
        );
        assert!(message(r#"{"code": 1}"#).starts_with("`code`: a string expected, got a number;"));
        assert!(
            message(r#"{"code": "1", "flag": 1}"#).starts_with("`flag`: true or false expected")
        );
        assert!(
            message("[]").starts_with("an object expected, got an array;"),
            "{}",
            message("[]")
        );
        assert!(message("").starts_with("the body is empty;"));
        assert!(
            message("{bad").starts_with(
                "the body is not valid JSON (key must be a string at line 1, column 2)"
            ),
            "{}",
            message("{bad")
        );
        assert!(message(r#"{"code": "1"} x"#)
            .starts_with("the body is not valid JSON (trailing characters"));
    }
}
