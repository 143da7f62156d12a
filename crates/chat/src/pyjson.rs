//! JSON text as Python's `json.dumps` writes it.
//!
//! Chat templates were written against Python: HF's `tojson` filter is
//! `json.dumps(x, ensure_ascii=False, indent=…, sort_keys=…)`, whose default separators
//! are `", "` and `": "` (not serde_json's compact form), and Kimi's XTML renderer spells
//! non-string tool arguments the same way. Token ids depend on those bytes, so they
//! are reproduced here rather than approximated.

use serde_json::Value;

/// Formatting options mirroring `json.dumps` keyword arguments.
#[derive(Debug, Clone, Copy, Default)]
pub struct PyJsonOptions {
    /// `indent=`: `None` writes one line with `", "` / `": "` separators.
    pub indent: Option<usize>,
    /// `sort_keys=`.
    pub sort_keys: bool,
    /// `ensure_ascii=`: escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
}

/// Serialises `value` like Python's `json.dumps(value, **options)`.
pub fn dumps(value: &Value, options: PyJsonOptions) -> String {
    let mut out = String::new();
    write_value(&mut out, value, options, 0);
    out
}

fn write_value(out: &mut String, value: &Value, o: PyJsonOptions, depth: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_string(out, s, o.ensure_ascii),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                separator(out, i, o, depth + 1);
                write_value(out, item, o, depth + 1);
            }
            closing(out, o, depth);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                separator(out, i, o, depth + 1);
                write_string(out, k, o.ensure_ascii);
                out.push_str(": ");
                write_value(out, v, o, depth + 1);
            }
            closing(out, o, depth);
            out.push('}');
        }
    }
}

/// Item separator: `", "` on one line; `",\n" + indent` when indenting.
fn separator(out: &mut String, index: usize, o: PyJsonOptions, depth: usize) {
    match o.indent {
        None => {
            if index > 0 {
                out.push_str(", ");
            }
        }
        Some(width) => {
            if index > 0 {
                out.push(',');
            }
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    }
}

fn closing(out: &mut String, o: PyJsonOptions, depth: usize) {
    if let Some(width) = o.indent {
        out.push('\n');
        out.push_str(&" ".repeat(width * depth));
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Recursively sorts object keys (Python `sort_keys` applied to the data itself), as
/// Kimi's renderer does before declaring tools.
pub fn deep_sort_keys(value: &Value) -> Value {
    match value {
        Value::Array(items) => Value::Array(items.iter().map(deep_sort_keys).collect()),
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), deep_sort_keys(v)))
                    .collect(),
            )
        }
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_dumps() {
        let v = json!({"b": [1, 2.5, "x"], "a": {"k": null, "é": true}, "e": [], "f": {}});
        let one_line = PyJsonOptions::default();
        assert_eq!(
            dumps(&v, one_line),
            r#"{"b": [1, 2.5, "x"], "a": {"k": null, "é": true}, "e": [], "f": {}}"#
        );
        let sorted = PyJsonOptions {
            sort_keys: true,
            ensure_ascii: true,
            ..one_line
        };
        assert_eq!(
            dumps(&v, sorted),
            r#"{"a": {"k": null, "\u00e9": true}, "b": [1, 2.5, "x"], "e": [], "f": {}}"#
        );
        let indented = PyJsonOptions {
            indent: Some(2),
            ..one_line
        };
        assert_eq!(
            dumps(&json!({"a": [1, {"b": "<&>"}]}), indented),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"<&>\"\n    }\n  ]\n}"
        );
        assert_eq!(dumps(&json!("😀\u{1}"), sorted), r#""\ud83d\ude00\u0001""#);
    }
}
