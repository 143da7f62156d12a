//! Compiling a JSON-schema subset into a [`Grammar`].

use std::collections::HashMap;

use serde_json::{Map, Value};

use crate::grammar::{
    ANY, ArrSpec, Grammar, NEVER, Node, NodeId, ObjSpec, Prop, StrSpec, T_ALL, T_ARR, T_BOOL,
    T_INT, T_NULL, T_NUM, T_OBJ, T_STR, Typed, base_nodes,
};
use crate::matcher::State;

/// Keywords that constrain values.
const SUPPORTED: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "$ref",
    "$defs",
    "definitions",
    "minLength",
    "maxLength",
];

/// Annotation keywords, accepted and ignored.
const IGNORED: &[&str] = &[
    "description",
    "title",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "format",
    "deprecated",
    "readOnly",
    "writeOnly",
];

/// Keywords that make a schema a typed node.
const TYPED: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
];

const SUPPORTED_LIST: &str = "type, properties, required, additionalProperties, items, minItems, maxItems, enum, \
     const, anyOf, oneOf, $ref, $defs, definitions, minLength, maxLength; ignored: description, title, default, \
     examples, $schema, $id, $comment, format, deprecated, readOnly, writeOnly";

/// Why a schema cannot be compiled; `path` is the JSON pointer of the offending schema.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    #[error("schema at {}: keyword `{keyword}` is not supported (supported: {SUPPORTED_LIST})", show(.path))]
    Unsupported { path: String, keyword: String },
    #[error("schema at {}: keyword `{keyword}`: {reason}", show(.path))]
    Invalid {
        path: String,
        keyword: String,
        reason: String,
    },
    #[error("schema at {}: matches no value", show(.path))]
    Empty { path: String },
}

fn show(path: &str) -> &str {
    if path.is_empty() { "root" } else { path }
}

fn invalid(path: &str, keyword: &str, reason: impl Into<String>) -> SchemaError {
    SchemaError::Invalid {
        path: path.to_string(),
        keyword: keyword.to_string(),
        reason: reason.into(),
    }
}

/// Escapes one JSON-pointer token.
fn escape_token(t: &str) -> String {
    t.replace('~', "~0").replace('/', "~1")
}

fn child(path: &str, a: &str, b: Option<&str>) -> String {
    match b {
        Some(b) => format!("{path}/{a}/{}", escape_token(b)),
        None => format!("{path}/{a}"),
    }
}

/// Decodes `%XX` escapes of a URI fragment.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn count(path: &str, m: &Map<String, Value>, key: &str) -> Result<Option<u32>, SchemaError> {
    match m.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n.min(u32::MAX as u64) as u32)),
            None => Err(invalid(path, key, "must be a non-negative integer")),
        },
    }
}

struct Compiler<'a> {
    root: &'a Value,
    nodes: Vec<Node>,
    by_path: HashMap<String, NodeId>,
    /// `(literal node, node its values must also match)` from `enum`/`const` next to other keywords.
    filters: Vec<(NodeId, NodeId)>,
}

impl<'a> Compiler<'a> {
    fn push(&mut self, n: Node) -> NodeId {
        self.nodes.push(n);
        (self.nodes.len() - 1) as NodeId
    }

    fn compile(&mut self, path: &str, v: &Value) -> Result<NodeId, SchemaError> {
        if let Some(&id) = self.by_path.get(path) {
            return Ok(id);
        }
        let m = match v {
            Value::Bool(true) => return Ok(ANY),
            Value::Bool(false) => return Ok(NEVER),
            Value::Object(m) => m,
            _ => {
                return Err(invalid(
                    path,
                    "(schema)",
                    "a schema must be an object or a boolean",
                ));
            }
        };
        let id = self.push(Node::Never);
        self.by_path.insert(path.to_string(), id);
        for k in m.keys() {
            if !SUPPORTED.contains(&k.as_str()) && !IGNORED.contains(&k.as_str()) {
                return Err(SchemaError::Unsupported {
                    path: path.to_string(),
                    keyword: k.clone(),
                });
            }
        }
        let typed = TYPED.iter().find(|k| m.contains_key(**k));
        let any = ["anyOf", "oneOf"]
            .into_iter()
            .filter(|k| m.contains_key(*k))
            .collect::<Vec<_>>();
        let reference = m.get("$ref");
        let mut kinds: Vec<&str> = typed
            .into_iter()
            .copied()
            .chain(any.iter().copied())
            .collect();
        if reference.is_some() {
            kinds.push("$ref");
        }
        if kinds.len() > 1 {
            let reason = format!(
                "cannot be combined with `{}` (intersections are not supported)",
                kinds[0]
            );
            return Err(invalid(path, kinds[1], reason));
        }
        let rest = if let Some(r) = reference {
            Some(Node::Ref(self.reference(path, r)?))
        } else if let Some(&kw) = any.first() {
            let Some(alts) = m[kw].as_array() else {
                return Err(invalid(path, kw, "must be an array of schemas"));
            };
            let mut ids = Vec::with_capacity(alts.len());
            for (i, a) in alts.iter().enumerate() {
                ids.push(self.compile(&child(path, kw, Some(&i.to_string())), a)?);
            }
            Some(Node::AnyOf(ids))
        } else if typed.is_some() {
            Some(Node::Typed(Box::new(self.typed(path, m)?)))
        } else {
            None
        };
        let node = match (literals(path, m)?, rest) {
            (Some(alts), None) => Node::Lits(alts),
            (Some(alts), Some(rest)) => {
                let r = self.push(rest);
                self.filters.push((id, r));
                Node::Lits(alts)
            }
            (None, Some(rest)) => rest,
            (None, None) => Node::Ref(ANY),
        };
        self.nodes[id as usize] = node;
        Ok(id)
    }

    /// Resolves a `$ref` (a `#` JSON pointer into the root schema) and compiles its target.
    fn reference(&mut self, path: &str, r: &Value) -> Result<NodeId, SchemaError> {
        let bad = |why: &str| invalid(path, "$ref", format!("{r}: {why}"));
        let s = r.as_str().ok_or_else(|| bad("must be a string"))?;
        let frag = s
            .strip_prefix('#')
            .ok_or_else(|| bad("only references into this schema (`#/...`) are supported"))?;
        let frag = percent_decode(frag).ok_or_else(|| bad("bad percent-encoding"))?;
        if !frag.is_empty() && !frag.starts_with('/') {
            return Err(bad(
                "anchors are not supported; use a JSON pointer like `#/$defs/name`",
            ));
        }
        let mut target = self.root;
        let mut canon = String::new();
        for tok in frag.split('/').skip(1) {
            let tok = tok.replace("~1", "/").replace("~0", "~");
            target = match target {
                Value::Object(m) => m.get(&tok),
                Value::Array(a) => tok.parse::<usize>().ok().and_then(|i| a.get(i)),
                _ => None,
            }
            .ok_or_else(|| bad("target not found"))?;
            canon.push('/');
            canon.push_str(&escape_token(&tok));
        }
        self.compile(&canon, target)
    }

    fn typed(&mut self, path: &str, m: &Map<String, Value>) -> Result<Typed, SchemaError> {
        let types = match m.get("type") {
            None => T_ALL,
            Some(Value::String(s)) => type_bit(path, s)?,
            Some(Value::Array(a)) => {
                let mut t = 0;
                for v in a {
                    let s = v.as_str().ok_or_else(|| {
                        invalid(path, "type", "must be a type name or an array of them")
                    })?;
                    t |= type_bit(path, s)?;
                }
                t
            }
            Some(_) => {
                return Err(invalid(
                    path,
                    "type",
                    "must be a type name or an array of them",
                ));
            }
        };
        let mut t = Typed::plain(types);
        t.obj = self.object(path, m)?;
        let items = match m.get("items") {
            None => ANY,
            Some(v) => self.compile(&child(path, "items", None), v)?,
        };
        let min = count(path, m, "minItems")?.unwrap_or(0);
        let max = count(path, m, "maxItems")?.unwrap_or(u32::MAX);
        t.arr = ArrSpec { items, min, max };
        let min = count(path, m, "minLength")?.unwrap_or(0);
        let max = count(path, m, "maxLength")?.unwrap_or(u32::MAX);
        t.str_ = StrSpec { min, max };
        Ok(t)
    }

    fn object(&mut self, path: &str, m: &Map<String, Value>) -> Result<ObjSpec, SchemaError> {
        let mut props = Vec::new();
        let mut names = Vec::new();
        if let Some(p) = m.get("properties") {
            let p = p
                .as_object()
                .ok_or_else(|| invalid(path, "properties", "must be an object"))?;
            for (name, v) in p {
                let node = self.compile(&child(path, "properties", Some(name)), v)?;
                props.push(Prop {
                    name: escaped(name),
                    node,
                });
                names.push(name.as_str());
            }
        }
        let additional = match m.get("additionalProperties") {
            None | Some(Value::Bool(true)) => Some(ANY),
            Some(Value::Bool(false)) => None,
            Some(v) => Some(self.compile(&child(path, "additionalProperties", None), v)?),
        };
        let mut required = Vec::new();
        if let Some(r) = m.get("required") {
            let bad = || invalid(path, "required", "must be an array of strings");
            for v in r.as_array().ok_or_else(bad)? {
                let name = v.as_str().ok_or_else(bad)?;
                let p = match names.iter().position(|n| *n == name) {
                    Some(p) => p,
                    None => {
                        let Some(node) = additional else {
                            let why = format!(
                                "`{name}` is not in `properties` and additionalProperties is false"
                            );
                            return Err(invalid(path, "required", why));
                        };
                        props.push(Prop {
                            name: escaped(name),
                            node,
                        });
                        names.push(name);
                        props.len() - 1
                    }
                };
                if !required.contains(&(p as u32)) {
                    required.push(p as u32);
                }
            }
        }
        Ok(ObjSpec::new(props, &required, additional))
    }

    /// Follows `$ref` chains; errors on a cycle of references.
    fn resolve(&self, mut id: NodeId) -> Result<NodeId, SchemaError> {
        let mut hops = 0;
        while let Node::Ref(t) = self.nodes[id as usize] {
            id = t;
            hops += 1;
            if hops > self.nodes.len() {
                let path = self
                    .by_path
                    .iter()
                    .find(|e| *e.1 == id)
                    .map(|e| e.0.clone())
                    .unwrap_or_default();
                return Err(invalid(&path, "$ref", "references form a cycle"));
            }
        }
        Ok(id)
    }

    /// Replaces every reference to a `$ref` node by its target.
    fn resolve_all(&mut self) -> Result<(), SchemaError> {
        for i in 0..self.nodes.len() {
            let mut n = self.nodes[i].clone();
            match &mut n {
                Node::Typed(t) => {
                    for p in &mut t.obj.props {
                        p.node = self.resolve(p.node)?;
                    }
                    if let Some(a) = t.obj.additional {
                        t.obj.additional = Some(self.resolve(a)?);
                    }
                    t.arr.items = self.resolve(t.arr.items)?;
                }
                Node::AnyOf(alts) => {
                    for a in alts {
                        *a = self.resolve(*a)?;
                    }
                }
                Node::Never | Node::Ref(_) | Node::Lits(_) => {}
            }
            self.nodes[i] = n;
        }
        for f in 0..self.filters.len() {
            self.filters[f].1 = self.resolve(self.filters[f].1)?;
        }
        Ok(())
    }
}

fn type_bit(path: &str, s: &str) -> Result<u8, SchemaError> {
    Ok(match s {
        "object" => T_OBJ,
        "array" => T_ARR,
        "string" => T_STR,
        "number" => T_NUM,
        "integer" => T_INT,
        "boolean" => T_BOOL,
        "null" => T_NULL,
        _ => return Err(invalid(path, "type", format!("unknown type `{s}`"))),
    })
}

/// A string as it appears between quotes in compact JSON.
fn escaped(s: &str) -> Vec<u8> {
    let q = Value::String(s.to_string()).to_string().into_bytes();
    q[1..q.len() - 1].to_vec()
}

/// The compact serializations allowed by `enum` and `const`, sorted; `None` if neither is present.
fn literals(path: &str, m: &Map<String, Value>) -> Result<Option<Vec<Vec<u8>>>, SchemaError> {
    let mut alts: Option<Vec<Vec<u8>>> = match m.get("enum") {
        None => None,
        Some(Value::Array(a)) => Some(a.iter().map(|v| v.to_string().into_bytes()).collect()),
        Some(_) => return Err(invalid(path, "enum", "must be an array")),
    };
    if let Some(c) = m.get("const") {
        let c = c.to_string().into_bytes();
        alts = Some(match alts {
            Some(a) => a.into_iter().filter(|x| *x == c).collect(),
            None => vec![c],
        });
    }
    if let Some(a) = &mut alts {
        a.sort();
        a.dedup();
    }
    Ok(alts)
}

/// Whether `bytes` form a complete value of `node`.
fn matches(g: &Grammar, node: NodeId, bytes: &[u8]) -> bool {
    let mut st = State::new(node);
    bytes.iter().all(|&b| st.feed_byte(g, b)) && st.is_complete(g)
}

/// Keeps only literals that also match their filter node, until nothing changes.
fn apply_filters(g: &mut Grammar, filters: &[(NodeId, NodeId)]) {
    loop {
        let mut changed = false;
        for &(lits, rest) in filters {
            let old = g.lits(lits);
            let kept: Vec<Vec<u8>> = old
                .iter()
                .filter(|a| matches(g, rest, a))
                .cloned()
                .collect();
            if kept.len() != old.len() {
                g.nodes[lits as usize] = Node::Lits(kept);
                changed = true;
            }
        }
        if !changed {
            return;
        }
    }
}

/// The types of `t` that have a finite value, given which nodes do.
fn live_types(t: &Typed, prod: &[bool]) -> u8 {
    let mut m = t.types;
    let o = &t.obj;
    let req_ok = o
        .props
        .iter()
        .enumerate()
        .all(|(p, pr)| o.required[p / 64] & (1 << (p % 64)) == 0 || prod[pr.node as usize]);
    if !req_ok {
        m &= !T_OBJ;
    }
    let a = &t.arr;
    if a.min > a.max || (a.min > 0 && !prod[a.items as usize]) {
        m &= !T_ARR;
    }
    if t.str_.min > t.str_.max {
        m &= !T_STR;
    }
    m
}

/// Drops everything that has no finite value: types, `anyOf` branches, properties, array items.
fn prune(g: &mut Grammar) -> Result<(), SchemaError> {
    let n = g.nodes.len();
    let mut prod = vec![false; n];
    loop {
        let mut changed = false;
        for i in 0..n {
            let p = match &g.nodes[i] {
                Node::Never | Node::Ref(_) => false,
                Node::Lits(l) => !l.is_empty(),
                Node::AnyOf(a) => a.iter().any(|&x| prod[x as usize]),
                Node::Typed(t) => live_types(t, &prod) != 0,
            };
            if p != prod[i] {
                prod[i] = p;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    if !prod[g.root as usize] {
        return Err(SchemaError::Empty {
            path: String::new(),
        });
    }
    for i in 0..n {
        let types = match &g.nodes[i] {
            Node::Typed(t) => live_types(t, &prod),
            _ => 0,
        };
        match &mut g.nodes[i] {
            Node::AnyOf(a) => a.retain(|&x| prod[x as usize]),
            Node::Typed(t) => {
                t.types = types;
                let o = &mut t.obj;
                for (p, pr) in o.props.iter().enumerate() {
                    if !prod[pr.node as usize] {
                        o.init_used[p / 64] |= 1 << (p % 64);
                    }
                }
                o.additional = o.additional.filter(|&a| prod[a as usize]);
                if !prod[t.arr.items as usize] {
                    t.arr.max = 0;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

impl Grammar {
    /// From a JSON schema (the `schema` member of OpenAI's `response_format.json_schema`).
    pub fn from_schema(schema: &Value) -> Result<Grammar, SchemaError> {
        let mut c = Compiler {
            root: schema,
            nodes: base_nodes(),
            by_path: HashMap::new(),
            filters: Vec::new(),
        };
        let root = c.compile("", schema)?;
        c.resolve_all()?;
        let root = c.resolve(root)?;
        let mut g = Grammar {
            nodes: c.nodes,
            root,
            ws_cap: crate::frame::WS_CAP,
        };
        apply_filters(&mut g, &c.filters);
        prune(&mut g)?;
        Ok(g)
    }
}
