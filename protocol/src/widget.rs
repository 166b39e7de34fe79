//! Jupyter widgets (ipywidgets) as text, for readers that cannot run them.
//!
//! A widget's display is a MIME bundle with `application/vnd.jupyter.widget-view+json`
//! (the `model_id` of the widget's comm) and a `text/plain` repr such as
//! `IntSlider(value=5, description='x')`. Only a widget manager (JupyterLab's) renders it;
//! the agent API, MCP and the web console show [`describe`]'s text instead (docs/widgets.md).

use serde_json::{Map, Value};

/// The MIME type of a widget view.
pub const VIEW_MIME: &str = "application/vnd.jupyter.widget-view+json";

/// The text form of a widget display: what the widget is, its value when it was displayed
/// and that it is interactive in JupyterLab. `None` when `data` is no widget view.
pub fn describe(data: &Map<String, Value>) -> Option<String> {
    let view = data.get(VIEW_MIME)?.as_object()?;
    let model_id = view.get("model_id").and_then(Value::as_str).unwrap_or("");
    let repr = match data.get("text/plain") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(lines)) => lines.iter().filter_map(Value::as_str).collect(),
        _ => String::new(),
    };
    let repr = repr.trim();
    let what = if repr.is_empty() {
        format!("model {model_id}")
    } else {
        repr.to_owned()
    };
    Some(format!(
        "[interactive widget {what} — interactive in JupyterLab; here it is shown as text]"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bundle(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn a_slider_names_its_class_description_and_value() {
        let data = bundle(json!({
            "text/plain": "IntSlider(value=5, description='x')",
            VIEW_MIME: {"version_major": 2, "version_minor": 0, "model_id": "abc"},
        }));
        assert_eq!(
            describe(&data).as_deref(),
            Some("[interactive widget IntSlider(value=5, description='x') — interactive in JupyterLab; here it is shown as text]")
        );
    }

    #[test]
    fn without_a_repr_the_model_id_is_named_and_other_bundles_are_no_widget() {
        let data = bundle(json!({VIEW_MIME: {"model_id": "m1"}}));
        assert!(describe(&data).unwrap_or_default().contains("model m1"));
        assert_eq!(describe(&bundle(json!({"text/plain": "5"}))), None);
        assert_eq!(describe(&bundle(json!({VIEW_MIME: "odd"}))), None);
    }
}
