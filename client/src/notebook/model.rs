//! The notebook file (nbformat 4 JSON) and its outputs: parsing and checking, writing it
//! back as nbformat does, and turning the events of a cell's execution into nbformat
//! outputs (<https://nbformat.readthedocs.io/en/latest/format_description.html#code-cell-outputs>).

use super::RunError;
use kernelgate_protocol::execution::{Display, Event};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

/// Parses and checks a notebook: nbformat 4, a list of well-formed cells. Old outputs of
/// code cells are cleared here, so what is written later is only this run's.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Value, RunError> {
    let not_notebook = |reason: String| RunError::NotNotebook {
        path: path.to_owned(),
        reason,
    };
    let mut nb: Value = serde_json::from_slice(bytes).map_err(|source| RunError::NotJson {
        path: path.to_owned(),
        source,
    })?;
    let Some(top) = nb.as_object_mut() else {
        return Err(not_notebook("the top level is not a JSON object".into()));
    };
    match top.get("nbformat").and_then(Value::as_i64) {
        Some(4) => {}
        Some(v) => {
            return Err(not_notebook(format!(
                "it is nbformat {v}; convert it with `jupyter nbconvert --to notebook`"
            )))
        }
        None => return Err(not_notebook("it has no \"nbformat\" number".into())),
    }
    let minor = top
        .get("nbformat_minor")
        .and_then(Value::as_i64)
        .ok_or_else(|| not_notebook("it has no \"nbformat_minor\" number".into()))?;
    if !top.get("metadata").is_some_and(Value::is_object) {
        return Err(not_notebook("it has no \"metadata\" object".into()));
    }
    let Some(cells) = top.get_mut("cells").and_then(Value::as_array_mut) else {
        return Err(not_notebook("it has no \"cells\" list".into()));
    };
    for (i, cell) in cells.iter_mut().enumerate() {
        let n = i + 1;
        let Some(cell) = cell.as_object_mut() else {
            return Err(not_notebook(format!("cell {n} is not an object")));
        };
        let kind = cell
            .get("cell_type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        if !matches!(kind.as_str(), "code" | "markdown" | "raw") {
            return Err(not_notebook(format!(
                "cell {n} has cell_type {:?}; expected code, markdown or raw",
                cell.get("cell_type").unwrap_or(&Value::Null)
            )));
        }
        if source_text(cell.get("source")).is_none() {
            return Err(not_notebook(format!(
                "cell {n} has no \"source\" string or list of strings"
            )));
        }
        if !cell.get("metadata").is_some_and(Value::is_object) {
            cell.insert("metadata".into(), json!({}));
        }
        // nbformat 4.5 made cell ids mandatory; nbformat itself fills in missing ones.
        if minor >= 5 && !cell.get("id").is_some_and(Value::is_string) {
            cell.insert(
                "id".into(),
                json!(uuid::Uuid::new_v4().simple().to_string()),
            );
        }
        if kind == "code" {
            cell.insert("outputs".into(), json!([]));
            cell.insert("execution_count".into(), Value::Null);
        }
    }
    Ok(nb)
}

/// A cell's source: nbformat allows one string or a list of lines.
pub(crate) fn source_text(source: Option<&Value>) -> Option<String> {
    match source? {
        Value::String(s) => Some(s.clone()),
        Value::Array(lines) => lines
            .iter()
            .map(|l| l.as_str())
            .collect::<Option<Vec<_>>>()
            .map(|l| l.concat()),
        _ => None,
    }
}

/// Indices of the code cells.
pub(crate) fn code_cells(nb: &Value) -> Vec<usize> {
    nb["cells"]
        .as_array()
        .map(|cells| {
            cells
                .iter()
                .enumerate()
                .filter(|(_, c)| c["cell_type"] == "code")
                .map(|(i, _)| i)
                .collect()
        })
        .unwrap_or_default()
}

/// The notebook as nbformat writes it: keys sorted, one-space indent, text split into
/// lines, a final newline. Diffs against files saved by Jupyter then stay small.
pub fn to_file_text(nb: &Value) -> String {
    let mut nb = nb.clone();
    split_lines(&mut nb);
    let nb = sorted(nb);
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b" ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    // Serializing a Value into a Vec cannot fail.
    let _ = serde::Serialize::serialize(&nb, &mut ser);
    let mut text = String::from_utf8_lossy(&out).into_owned();
    text.push('\n');
    text
}

pub(crate) fn write(path: &Path, nb: &Value) -> Result<(), RunError> {
    let err = |source| RunError::Write {
        path: path.to_owned(),
        source,
    };
    // Write next to the target and rename, so a failed run never leaves half a notebook.
    let tmp = path.with_file_name(format!(
        ".{}.kernelgate-tmp",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    std::fs::write(&tmp, to_file_text(nb)).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err(e)
    })
}

fn sorted(v: Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// nbformat's `split_lines`: sources, stream text and textual mime data as line lists.
fn split_lines(nb: &mut Value) {
    fn lines(v: &mut Value) {
        if let Value::String(s) = v {
            *v = Value::Array(
                s.split_inclusive('\n')
                    .map(|l| Value::String(l.to_owned()))
                    .collect(),
            );
        }
    }
    fn bundle(data: &mut Value) {
        if let Some(data) = data.as_object_mut() {
            for (mime, value) in data.iter_mut() {
                if mime.starts_with("text/")
                    || mime == "application/javascript"
                    || mime == "image/svg+xml"
                {
                    lines(value);
                }
            }
        }
    }
    let Some(cells) = nb["cells"].as_array_mut() else {
        return;
    };
    for cell in cells {
        lines(&mut cell["source"]);
        if let Some(attachments) = cell.get_mut("attachments").and_then(Value::as_object_mut) {
            attachments.values_mut().for_each(bundle);
        }
        if let Some(outputs) = cell.get_mut("outputs").and_then(Value::as_array_mut) {
            for out in outputs {
                match out["output_type"].as_str() {
                    Some("execute_result" | "display_data") => bundle(&mut out["data"]),
                    Some("stream") => lines(&mut out["text"]),
                    _ => {}
                }
            }
        }
    }
}

/// What the outputs of the notebook so far need to remember between messages: where each
/// display id was shown (`update_display_data` changes every copy, in any cell) and whether
/// a `clear_output(wait=True)` is pending.
#[derive(Debug, Default)]
pub struct Outputs {
    displays: HashMap<String, Vec<(usize, usize)>>,
    clear_pending: bool,
}

impl Outputs {
    /// Applies one event of the request running `cells[cell]`, like nbclient's
    /// `process_message`; events that are not outputs are ignored.
    pub fn apply(&mut self, cells: &mut [Value], cell: usize, event: &Event) {
        let (output, display_id) = match event {
            Event::Stream { name, text } => {
                let name = if name.is_empty() { "stdout" } else { name };
                (
                    json!({"output_type": "stream", "name": name, "text": text}),
                    None,
                )
            }
            Event::Display(d) => {
                if let Some(id) = &d.display_id {
                    self.update_display(cells, id, d);
                }
                let output = if d.is_result {
                    json!({
                        "output_type": "execute_result",
                        "execution_count": d.execution_count,
                        "data": d.data,
                        "metadata": d.metadata,
                    })
                } else {
                    json!({"output_type": "display_data", "data": d.data, "metadata": d.metadata})
                };
                (output, d.display_id.clone())
            }
            Event::UpdateDisplay(d) => {
                if let Some(id) = &d.display_id {
                    self.update_display(cells, id, d);
                }
                return;
            }
            Event::Error(e) => (
                json!({
                    "output_type": "error",
                    "ename": e.ename,
                    "evalue": e.evalue,
                    "traceback": e.traceback,
                }),
                None,
            ),
            Event::ClearOutput { wait: true } => {
                self.clear_pending = true;
                return;
            }
            Event::ClearOutput { wait: false } => {
                self.clear(cells, cell);
                return;
            }
            _ => return,
        };
        if self.clear_pending {
            self.clear(cells, cell);
        }
        let Some(outs) = cells
            .get_mut(cell)
            .and_then(|c| c.get_mut("outputs"))
            .and_then(Value::as_array_mut)
        else {
            return;
        };
        // Consecutive stream messages of one name are one output, as Jupyter saves them.
        if output["output_type"] == "stream" {
            if let Some(last) = outs.last_mut() {
                if last["output_type"] == "stream" && last["name"] == output["name"] {
                    let mut text = last["text"].as_str().unwrap_or("").to_owned();
                    text.push_str(output["text"].as_str().unwrap_or(""));
                    last["text"] = Value::String(text);
                    return;
                }
            }
        }
        if let Some(id) = display_id {
            self.displays
                .entry(id)
                .or_default()
                .push((cell, outs.len()));
        }
        outs.push(output);
    }

    fn clear(&mut self, cells: &mut [Value], cell: usize) {
        if let Some(outs) = cells
            .get_mut(cell)
            .and_then(|c| c.get_mut("outputs"))
            .and_then(Value::as_array_mut)
        {
            outs.clear();
        }
        for places in self.displays.values_mut() {
            places.retain(|(c, _)| *c != cell);
        }
        self.clear_pending = false;
    }

    fn update_display(&self, cells: &mut [Value], id: &str, display: &Display) {
        for &(cell, index) in self.displays.get(id).into_iter().flatten() {
            if let Some(out) = cells
                .get_mut(cell)
                .and_then(|c| c.get_mut("outputs"))
                .and_then(|o| o.get_mut(index))
            {
                out["data"] = Value::Object(display.data.clone());
                out["metadata"] = Value::Object(display.metadata.clone());
            }
        }
    }
}

pub(crate) fn has_tag(cell: &Value, tag: &str) -> bool {
    cell["metadata"]["tags"]
        .as_array()
        .is_some_and(|tags| tags.iter().any(|t| t == tag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn notebook(cells: Value) -> Vec<u8> {
        json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {"custom": {"keep": 1}}, "cells": cells})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn parse_clears_outputs_and_keeps_unknown_fields() {
        let bytes = notebook(json!([
            {"cell_type": "code", "id": "a", "source": ["x = 1\n", "x"], "metadata": {"tags": ["t"]},
             "outputs": [{"output_type": "stream", "name": "stdout", "text": "old"}],
             "execution_count": 7, "x-extra": true},
            {"cell_type": "markdown", "source": "# Title", "metadata": {}},
        ]));
        let nb = parse(Path::new("n.ipynb"), &bytes).expect("valid");
        let cell = &nb["cells"][0];
        assert_eq!(cell["outputs"], json!([]));
        assert_eq!(cell["execution_count"], Value::Null);
        assert_eq!(cell["x-extra"], json!(true));
        assert_eq!(cell["id"], "a");
        assert!(nb["cells"][1]["id"].is_string(), "4.5 cells get an id");
        assert_eq!(nb["metadata"]["custom"]["keep"], 1);
        assert_eq!(source_text(cell.get("source")).as_deref(), Some("x = 1\nx"));
    }

    #[test]
    fn parse_explains_what_is_wrong() {
        let p = Path::new("n.ipynb");
        let e = parse(p, b"{not json").expect_err("not JSON");
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        let e = parse(
            p,
            br#"{"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": []}"#,
        )
        .expect_err("v3");
        assert!(e.to_string().contains("nbformat 3"), "{e}");
        let e = parse(p, &notebook(json!([{"cell_type": "code"}]))).expect_err("no source");
        assert!(e.to_string().contains("cell 1"), "{e}");
    }

    fn stream(name: &str, text: &str) -> Event {
        Event::Stream {
            name: name.into(),
            text: text.into(),
        }
    }

    fn display(text: &str, display_id: Option<&str>, result: Option<i64>) -> Display {
        Display {
            data: json!({"text/plain": text})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            metadata: Map::new(),
            display_id: display_id.map(str::to_owned),
            is_result: result.is_some(),
            execution_count: result,
        }
    }

    #[test]
    fn outputs_merge_streams_clear_and_update_displays() {
        let mut cells = vec![json!({"outputs": []}), json!({"outputs": []})];
        let mut o = Outputs::default();
        o.apply(&mut cells, 0, &stream("stdout", "a"));
        o.apply(&mut cells, 0, &stream("stdout", "b\n"));
        o.apply(&mut cells, 0, &stream("stderr", "w\n"));
        o.apply(
            &mut cells,
            0,
            &Event::Display(display("v1", Some("d"), None)),
        );
        o.apply(
            &mut cells,
            1,
            &Event::UpdateDisplay(display("v2", Some("d"), None)),
        );
        assert_eq!(cells[0]["outputs"][0]["text"], "ab\n");
        assert_eq!(cells[0]["outputs"][1]["name"], "stderr");
        assert_eq!(cells[0]["outputs"][2]["data"]["text/plain"], "v2");
        assert_eq!(cells[1]["outputs"], json!([]), "an update adds no output");

        o.apply(&mut cells, 1, &stream("stdout", "1"));
        o.apply(&mut cells, 1, &Event::ClearOutput { wait: true });
        assert_eq!(
            cells[1]["outputs"].as_array().map(Vec::len),
            Some(1),
            "wait: not yet"
        );
        o.apply(&mut cells, 1, &Event::Display(display("2", None, Some(3))));
        assert_eq!(
            cells[1]["outputs"],
            json!([{"output_type": "execute_result", "execution_count": 3,
                    "data": {"text/plain": "2"}, "metadata": {}}])
        );
    }

    #[test]
    fn file_text_is_what_nbformat_writes() {
        let nb = json!({"nbformat_minor": 5, "nbformat": 4, "metadata": {}, "cells": [
            {"source": "a\nb", "cell_type": "code", "id": "x", "metadata": {}, "execution_count": 1,
             "outputs": [{"output_type": "display_data", "metadata": {},
                          "data": {"text/plain": "1\n2", "image/png": "iVBO\n", "application/json": {"b": 1, "a": 2}}}]}]});
        let text = to_file_text(&nb);
        let back: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(back["cells"][0]["source"], json!(["a\n", "b"]));
        let data = &back["cells"][0]["outputs"][0]["data"];
        assert_eq!(data["text/plain"], json!(["1\n", "2"]));
        assert_eq!(data["image/png"], "iVBO\n");
        assert!(text.starts_with("{\n \"cells\": [\n"), "{text}");
        assert!(text.ends_with("}\n"));
        assert!(
            text.find("\"a\": 2").lt(&text.find("\"b\": 1")),
            "keys sorted"
        );
    }
}
