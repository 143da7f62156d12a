//! Tool-call arguments as Kimi's XTML spells them.
//!
//! Each argument becomes `<|open|>argument key="k" type="T"<|sep|>VALUE<|close|>…`,
//! where `T` is the JSON type name and VALUE is the string itself for strings and the
//! JSON text otherwise. When the arguments arrive as a JSON *string* (the OpenAI wire
//! form), non-string values keep their literal text (`1e2` stays `1e2`); when they
//! arrive as an object they are re-serialised Python-style. Arguments that are not a
//! JSON object are passed through whole in a `json type="object"` block.

use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::pyjson::{PyJsonOptions, dumps};

/// How a call's arguments are rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenderedArgs {
    /// `(key, type, value text)` per argument, in the order given.
    Fields(Vec<(String, &'static str, String)>),
    /// Unparseable arguments, emitted verbatim in a `json` block.
    RawJson(String),
}

/// Normalises arguments; `None` if they are neither an object, a string nor null.
pub fn render_args(args: &Value) -> Option<RenderedArgs> {
    match args {
        Value::Null => Some(RenderedArgs::Fields(Vec::new())),
        Value::Object(map) => Some(RenderedArgs::Fields(
            map.iter()
                .map(|(k, v)| (k.clone(), type_name(v), value_text(v)))
                .collect(),
        )),
        Value::String(s) if s.is_empty() => Some(RenderedArgs::Fields(Vec::new())),
        Value::String(s) => Some(match parse_raw_object(s) {
            Some(fields) => RenderedArgs::Fields(fields),
            None => RenderedArgs::RawJson(s.clone()),
        }),
        _ => None,
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => dumps(other, PyJsonOptions::default()),
    }
}

/// Parses a JSON object keeping each value's raw text; duplicate keys are kept.
fn parse_raw_object(s: &str) -> Option<Vec<(String, &'static str, String)>> {
    let entries: RawEntries = serde_json::from_str(s).ok()?;
    entries
        .0
        .into_iter()
        .map(|(key, raw)| {
            let text = raw.get();
            let kind = match text.as_bytes().first()? {
                b'"' => "string",
                b'{' => "object",
                b'[' => "array",
                b't' | b'f' => "boolean",
                b'n' => "null",
                _ => "number",
            };
            let value = if kind == "string" {
                serde_json::from_str::<String>(text).ok()?
            } else {
                text.to_string()
            };
            Some((key, kind, value))
        })
        .collect()
}

/// A JSON object as an ordered list of (key, raw value) pairs.
struct RawEntries(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for RawEntries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawEntries;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawEntries, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Box<RawValue>>()? {
                    out.push((k, v));
                }
                Ok(RawEntries(out))
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: &[(&str, &'static str, &str)]) -> RenderedArgs {
        RenderedArgs::Fields(
            v.iter()
                .map(|(k, t, x)| (k.to_string(), *t, x.to_string()))
                .collect(),
        )
    }

    #[test]
    fn string_arguments_keep_literal_text() {
        let got = render_args(&json!(
            r#"{"city": "Paris", "n": 1e2, "opts": {"a":1}, "ok": true}"#
        ));
        assert_eq!(
            got,
            Some(fields(&[
                ("city", "string", "Paris"),
                ("n", "number", "1e2"),
                ("opts", "object", r#"{"a":1}"#),
                ("ok", "boolean", "true"),
            ]))
        );
    }

    #[test]
    fn object_arguments_are_python_spaced() {
        let got = render_args(&json!({"list": [1, 2], "q": "x", "z": null}));
        assert_eq!(
            got,
            Some(fields(&[
                ("list", "array", "[1, 2]"),
                ("q", "string", "x"),
                ("z", "null", "null"),
            ]))
        );
    }

    #[test]
    fn unparseable_arguments_become_a_json_block() {
        assert_eq!(
            render_args(&json!("{not json")),
            Some(RenderedArgs::RawJson("{not json".into()))
        );
        assert_eq!(
            render_args(&json!("[1,2]")),
            Some(RenderedArgs::RawJson("[1,2]".into()))
        );
        assert_eq!(render_args(&json!(3)), None);
    }
}
