//! `Grammar::from_schema`: the supported JSON-schema subset.

mod common;

use common::{run, schema, valid};
use fathom_constrain::{Grammar, Matcher, SchemaError};
use serde_json::json;

fn person() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "full name"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "role": {"enum": ["admin", "user"]}
        },
        "required": ["name", "age", "role"],
        "additionalProperties": false
    })
}

#[test]
fn person_accepts_valid_documents() {
    let g = schema(person());
    assert!(valid(
        &g,
        r#"{"name":"Ann","age":41,"tags":["a","b"],"role":"admin"}"#
    ));
    assert!(
        valid(&g, r#"{ "role" : "user", "age": -3, "name": "" }"#),
        "any order"
    );
    assert!(valid(&g, r#"{"name":"B","age":0,"role":"user","tags":[]}"#));
}

#[test]
fn person_rejections() {
    let g = schema(person());
    // Missing required keys: `}` cannot close the object.
    assert_eq!(run(&g, br#"{"name":"Ann","age":41}"#), None);
    assert_eq!(run(&g, br#"{"name":"Ann","age":41"#), Some(false));
    assert_eq!(run(&g, b"{}"), None);
    // Wrong types.
    assert_eq!(run(&g, br#"{"name":5"#), None);
    assert_eq!(run(&g, br#"{"age":"41""#), None);
    assert_eq!(run(&g, br#"{"tags":"a""#), None);
    assert_eq!(run(&g, br#"{"tags":[1]"#), None);
    assert_eq!(run(&g, b"[]"), None);
    // Extra key with additionalProperties false: refused at its first distinguishing byte.
    assert_eq!(run(&g, br#"{"x"#), None);
    assert_eq!(run(&g, br#"{"nam"#), Some(false));
    assert_eq!(run(&g, br#"{"namex"#), None);
    assert_eq!(
        run(&g, br#"{"name":"a","name"#),
        None,
        "each key at most once"
    );
    // Limits and enums.
    assert_eq!(run(&g, br#"{"tags":["a","b","c"]"#), None, "maxItems 2");
    assert_eq!(run(&g, br#"{"tags":["a","b","#), None);
    assert_eq!(run(&g, br#"{"age":1.5"#), None);
    assert_eq!(run(&g, br#"{"age":1e3"#), None);
    assert_eq!(run(&g, br#"{"role":"guest""#), None);
    assert_eq!(run(&g, br#"{"role":"adm"#), Some(false));
    assert_eq!(run(&g, br#"{"role":"admin ""#), None);
    assert_eq!(run(&g, br#"{"role":"admin","#), Some(false));
    // After every declared key is used, a comma would lead nowhere.
    let full = br#"{"name":"A","age":1,"tags":[],"role":"user""#;
    assert_eq!(run(&g, full), Some(false));
    assert_eq!(run(&g, &[&full[..], b","].concat()), None);
}

#[test]
fn recursive_ref() {
    let s = json!({
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}
                },
                "required": ["value"],
                "additionalProperties": false
            }
        }
    });
    let g = schema(s);
    assert!(valid(&g, r#"{"value":1}"#));
    assert!(valid(
        &g,
        r#"{"value":1,"children":[{"value":2,"children":[{"value":3,"children":[]}]},{"value":4}]}"#
    ));
    assert_eq!(
        run(&g, br#"{"value":1,"children":[{"children":[]}]}"#),
        None
    );
    assert_eq!(run(&g, br#"{"value":1,"children":[{"value":"x"#), None);
    // `definitions` works too, and refs may point at the root.
    let g = schema(json!({
        "definitions": {"leaf": {"type": "string"}},
        "type": "array",
        "items": {"anyOf": [{"$ref": "#/definitions/leaf"}, {"$ref": "#"}]}
    }));
    assert!(valid(&g, r#"["a",["b",[]],[]]"#));
    assert_eq!(run(&g, b"[1]"), None);
}

#[test]
fn any_of_and_one_of() {
    let g = schema(
        json!({"type": "object", "properties": {"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}),
    );
    assert!(valid(&g, r#"{"v":"x"}"#));
    assert!(valid(&g, r#"{"v":12}"#));
    assert_eq!(run(&g, br#"{"v":1.5}"#), None);
    assert_eq!(run(&g, br#"{"v":true}"#), None);
    assert_eq!(run(&g, br#"{"v":null}"#), None);
    // Overlapping branches: both stay alive until the bytes decide.
    let g = schema(json!({"oneOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false},
        {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "null"}}, "required": ["b"], "additionalProperties": false}
    ]}));
    assert!(valid(&g, r#"{"a":1}"#));
    assert!(valid(&g, r#"{"a":"s","b":null}"#));
    assert_eq!(run(&g, br#"{"a":"s"}"#), None);
    assert_eq!(run(&g, br#"{"a":1,"b":null}"#), None);
    // A type array needs no branches.
    let g = schema(json!({"type": ["string", "null"], "maxLength": 2}));
    assert!(valid(&g, r#""ab""#) && valid(&g, "null"));
    assert_eq!(run(&g, br#""abc""#), None);
}

#[test]
fn const_and_enum() {
    let g = schema(
        json!({"type": "object", "properties": {"k": {"const": "fixed"}, "o": {"const": {"x": [1, null]}}}}),
    );
    assert!(valid(&g, r#"{"k":"fixed","o":{"x":[1,null]}}"#));
    assert_eq!(run(&g, br#"{"k":"fixe""#), None);
    assert_eq!(
        run(&g, br#"{"o":{"x": [1,null]}}"#),
        None,
        "enum values are matched compactly"
    );
    let g = schema(json!({"enum": [1, 10, 1.5, "a", null, [true]]}));
    for ok in ["1", "10", "1.5", "\"a\"", "null", "[true]"] {
        assert!(valid(&g, ok), "{ok}");
    }
    for bad in ["2", "100", "\"b\"", "[false]", "true"] {
        assert_eq!(run(&g, bad.as_bytes()).filter(|c| *c), None, "{bad}");
    }
    let mut m = Matcher::new(&g);
    assert!(
        m.feed(b"1") && m.is_complete() && !m.is_finished(),
        "1 may continue as 10 or 1.5"
    );
    let mut m = Matcher::new(&g);
    assert!(m.feed(b"null") && m.is_finished());
    // `enum` next to `type` keeps only the values of that type.
    let g = schema(json!({"type": "string", "enum": ["a", 1, "b"]}));
    assert!(valid(&g, "\"a\"") && valid(&g, "\"b\""));
    assert_eq!(run(&g, b"1"), None);
}

#[test]
fn strings_count_characters() {
    let g = schema(json!({"type": "string", "minLength": 2, "maxLength": 3}));
    assert!(valid(&g, "\"éé\""), "two characters, four bytes");
    assert!(valid(&g, "\"é😀\\n\""));
    assert!(
        valid(&g, "\"\\ud83d\\ude00a\""),
        "a surrogate pair is one character"
    );
    assert_eq!(run(&g, "\"é\"".as_bytes()), None);
    assert_eq!(run(&g, "\"abcd".as_bytes()), None);
    assert_eq!(run(&g, "\"ab\\u0041\\".as_bytes()), None);
}

#[test]
fn numbers_and_top_level_scalars() {
    let g = schema(json!({"type": "number"}));
    let mut m = Matcher::new(&g);
    assert!(m.feed(b"-12.5e3") && m.is_complete() && !m.is_finished());
    assert!(!m.feed(b" "));
    let g = schema(json!({"type": "boolean"}));
    let mut m = Matcher::new(&g);
    assert!(m.feed(b"fals") && !m.is_complete());
    assert!(m.feed(b"e") && m.is_complete() && m.is_finished());
    let g = schema(json!({"type": "string"}));
    let mut m = Matcher::new(&g);
    assert!(m.feed(b"\"x\"") && m.is_finished());
}

#[test]
fn empty_and_true_schemas_match_anything() {
    for s in [
        json!({}),
        json!(true),
        json!({"description": "anything", "$schema": "x"}),
    ] {
        let g = schema(s);
        for doc in ["1", "\"s\"", "[1,{\"a\":null}]", "{}", "true", "null"] {
            assert!(valid(&g, doc), "{doc}");
        }
    }
}

#[test]
fn arrays_and_additional_properties() {
    let g = schema(
        json!({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}),
    );
    assert!(valid(&g, "[1]") && valid(&g, "[1, 2, 3]"));
    assert_eq!(run(&g, b"[]"), None);
    assert_eq!(run(&g, b"[1,2,3,"), None);
    let g = schema(
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "boolean"}}),
    );
    assert!(valid(&g, r#"{"a":1,"b":true,"c":false}"#));
    assert_eq!(run(&g, br#"{"b":1"#), None);
    assert_eq!(run(&g, br#"{"a":true"#), None);
    assert_eq!(
        run(&g, br#"{"a":1,"a":"#),
        None,
        "a declared key is used once"
    );
    // Absent additionalProperties: any other key, any value.
    let g = schema(
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"]}),
    );
    assert!(valid(&g, r#"{"z":[{}],"q":"w","a":2}"#));
    assert_eq!(
        run(&g, br#"{"a":2}"#),
        None,
        "required key `z` comes from additionalProperties"
    );
    // Empty object schema with nothing allowed.
    let g = schema(json!({"type": "object", "additionalProperties": false}));
    assert!(valid(&g, "{ }"));
    assert_eq!(run(&g, b"{\""), None);
}

#[test]
fn many_properties() {
    let mut props = serde_json::Map::new();
    for i in 0..150 {
        props.insert(format!("p{i}"), json!({"type": "integer"}));
    }
    let required: Vec<String> = (0..150).step_by(7).map(|i| format!("p{i}")).collect();
    let g = schema(
        json!({"type": "object", "properties": props, "required": required, "additionalProperties": false}),
    );
    let all: Vec<String> = (0..150).rev().map(|i| format!("\"p{i}\":{i}")).collect();
    assert!(valid(&g, &format!("{{{}}}", all.join(","))));
    let req: Vec<String> = (0..150).step_by(7).map(|i| format!("\"p{i}\":0")).collect();
    assert!(valid(&g, &format!("{{{}}}", req.join(","))));
    assert_eq!(
        run(&g, format!("{{{}}}", req[1..].join(",")).as_bytes()),
        None
    );
    assert_eq!(run(&g, br#"{"p140":1,"p140""#), None);
    assert_eq!(run(&g, br#"{"p150""#), None);
}

#[test]
fn unsatisfiable_parts_are_pruned() {
    // An optional property whose schema matches nothing can never be typed.
    let g = schema(
        json!({"type": "object", "properties": {"a": false, "b": {"type": "null"}}, "additionalProperties": false}),
    );
    assert!(valid(&g, r#"{"b":null}"#));
    assert_eq!(run(&g, br#"{"a"#), None);
    let g = schema(json!({"anyOf": [{"enum": []}, {"type": "null"}]}));
    assert!(valid(&g, "null"));
    assert!(matches!(
        Grammar::from_schema(&json!(false)),
        Err(SchemaError::Empty { .. })
    ));
    let e = Grammar::from_schema(
        &json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    )
    .unwrap_err();
    assert!(e.to_string().contains("matches no value"), "{e}");
}

fn err(s: serde_json::Value) -> String {
    Grammar::from_schema(&s)
        .expect_err("schema should be refused")
        .to_string()
}

#[test]
fn errors_name_path_and_keyword() {
    let e =
        err(json!({"type": "object", "properties": {"name": {"type": "string", "pattern": "^a"}}}));
    assert!(
        e.starts_with(
            "schema at /properties/name: keyword `pattern` is not supported (supported: type,"
        ),
        "{e}"
    );
    let e = err(json!({"patternProperties": {}}));
    assert!(
        e.starts_with("schema at root: keyword `patternProperties` is not supported"),
        "{e}"
    );
    for kw in [
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "dependentRequired",
        "uniqueItems",
        "prefixItems",
        "minProperties",
        "propertyNames",
    ] {
        let e = err(json!({"type": "object", "properties": {"a": {"items": {kw: 1}}}}));
        assert!(
            e.contains("/properties/a/items") && e.contains(&format!("`{kw}`")),
            "{e}"
        );
    }
    let e = err(json!({"$defs": {"x": {"type": "strin"}}, "$ref": "#/$defs/x"}));
    assert!(e.contains("/$defs/x") && e.contains("`type`"), "{e}");
    let e = err(json!({"$ref": "#/$defs/missing"}));
    assert!(e.contains("`$ref`") && e.contains("not found"), "{e}");
    let e = err(
        json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    );
    assert!(e.contains("cycle"), "{e}");
    let e = err(json!({"type": "object", "anyOf": [{}]}));
    assert!(
        e.contains("`anyOf`") && e.contains("cannot be combined"),
        "{e}"
    );
    let e = err(json!({"required": ["x"], "additionalProperties": false}));
    assert!(e.contains("`required`"), "{e}");
    let e = err(json!({"maxItems": -1}));
    assert!(e.contains("`maxItems`"), "{e}");
}
