//! The compiled grammar: a table of schema nodes that matcher frames refer to by index.

/// Index of a node in [`Grammar::nodes`].
pub(crate) type NodeId = u32;

/// Any JSON value.
pub(crate) const ANY: NodeId = 0;
/// No value at all.
pub(crate) const NEVER: NodeId = 1;
/// The literal `true`.
pub(crate) const TRUE: NodeId = 2;
/// The literal `false`.
pub(crate) const FALSE: NodeId = 3;
/// The literal `null`.
pub(crate) const NULL: NodeId = 4;

pub(crate) const T_OBJ: u8 = 1;
pub(crate) const T_ARR: u8 = 2;
pub(crate) const T_STR: u8 = 4;
pub(crate) const T_NUM: u8 = 8;
pub(crate) const T_INT: u8 = 16;
pub(crate) const T_BOOL: u8 = 32;
pub(crate) const T_NULL: u8 = 64;
/// Every type (`number` already covers `integer`).
pub(crate) const T_ALL: u8 = T_OBJ | T_ARR | T_STR | T_NUM | T_BOOL | T_NULL;

/// A compiled grammar: any JSON object (`{"type":"json_object"}`) or a JSON-schema subset.
#[derive(Debug)]
pub struct Grammar {
    pub(crate) nodes: Vec<Node>,
    pub(crate) root: NodeId,
    /// Most consecutive structural whitespace bytes.
    pub(crate) ws_cap: u8,
}

/// One schema node.
#[derive(Debug, Clone)]
pub(crate) enum Node {
    /// Matches nothing.
    Never,
    /// A `$ref`; only exists while compiling.
    Ref(NodeId),
    /// Values of the given types, with per-type constraints.
    Typed(Box<Typed>),
    /// Exactly one of these byte strings (sorted, deduplicated).
    Lits(Vec<Vec<u8>>),
    /// Any of these nodes.
    AnyOf(Vec<NodeId>),
}

/// A value of one of `types` (a `T_*` mask); each spec applies to its own type.
#[derive(Debug, Clone)]
pub(crate) struct Typed {
    pub types: u8,
    pub obj: ObjSpec,
    pub arr: ArrSpec,
    pub str_: StrSpec,
}

#[derive(Debug, Clone)]
pub(crate) struct ObjSpec {
    /// Declared properties; the index is the bit in the `used` words.
    pub props: Vec<Prop>,
    /// Bits of required properties.
    pub required: Vec<u64>,
    /// Bits set when an object starts (properties whose schema matches nothing).
    pub init_used: Vec<u64>,
    /// Schema of other keys; `None` forbids them.
    pub additional: Option<NodeId>,
    /// Trie over the JSON-escaped property names.
    pub keys: KeyTrie,
}

#[derive(Debug, Clone)]
pub(crate) struct Prop {
    /// The name as it appears between quotes in JSON (escaped).
    pub name: Vec<u8>,
    pub node: NodeId,
}

#[derive(Debug, Clone)]
pub(crate) struct ArrSpec {
    pub items: NodeId,
    pub min: u32,
    pub max: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct StrSpec {
    /// Length bounds in characters (code points).
    pub min: u32,
    pub max: u32,
}

/// Number of `u64` words for a set of `n` property bits (at least one).
pub(crate) fn words(n: usize) -> usize {
    n.div_ceil(64).max(1)
}

/// A byte trie over property names; node 0 is the root.
#[derive(Debug, Clone)]
pub(crate) struct KeyTrie {
    nodes: Vec<KeyNode>,
}

#[derive(Debug, Clone)]
struct KeyNode {
    children: Vec<(u8, u32)>,
    term: Option<u32>,
    /// Properties whose names pass through this node.
    mask: Vec<u64>,
}

impl KeyTrie {
    pub fn new(names: &[&[u8]]) -> KeyTrie {
        let w = words(names.len());
        let mut nodes = vec![KeyNode {
            children: Vec::new(),
            term: None,
            mask: vec![0; w],
        }];
        for (p, name) in names.iter().enumerate() {
            let mut at = 0usize;
            nodes[0].mask[p / 64] |= 1 << (p % 64);
            for &b in name.iter() {
                let next = match nodes[at].children.iter().find(|c| c.0 == b) {
                    Some(&(_, c)) => c as usize,
                    None => {
                        nodes.push(KeyNode {
                            children: Vec::new(),
                            term: None,
                            mask: vec![0; w],
                        });
                        let c = nodes.len() - 1;
                        nodes[at].children.push((b, c as u32));
                        c
                    }
                };
                at = next;
                nodes[at].mask[p / 64] |= 1 << (p % 64);
            }
            nodes[at].term = Some(p as u32);
        }
        KeyTrie { nodes }
    }

    pub fn child(&self, at: u32, b: u8) -> Option<u32> {
        let n = &self.nodes[at as usize];
        n.children.iter().find(|c| c.0 == b).map(|c| c.1)
    }

    pub fn term(&self, at: u32) -> Option<u32> {
        self.nodes[at as usize].term
    }

    pub fn mask(&self, at: u32) -> &[u64] {
        &self.nodes[at as usize].mask
    }
}

impl ObjSpec {
    /// Builds the key trie and bit sets for `props`.
    pub fn new(props: Vec<Prop>, required: &[u32], additional: Option<NodeId>) -> ObjSpec {
        let w = words(props.len());
        let mut req = vec![0u64; w];
        for &p in required {
            req[p as usize / 64] |= 1 << (p % 64);
        }
        let names: Vec<&[u8]> = props.iter().map(|p| p.name.as_slice()).collect();
        let keys = KeyTrie::new(&names);
        ObjSpec {
            props,
            required: req,
            init_used: vec![0; w],
            additional,
            keys,
        }
    }
}

impl Typed {
    /// Any value of the types in `types`, unconstrained.
    pub fn plain(types: u8) -> Typed {
        Typed {
            types,
            obj: ObjSpec::new(Vec::new(), &[], Some(ANY)),
            arr: ArrSpec {
                items: ANY,
                min: 0,
                max: u32::MAX,
            },
            str_: StrSpec {
                min: 0,
                max: u32::MAX,
            },
        }
    }
}

impl Grammar {
    /// Any JSON value whose top level is an object.
    pub fn json_object() -> Grammar {
        let mut nodes = base_nodes();
        nodes.push(Node::Typed(Box::new(Typed::plain(T_OBJ))));
        Grammar {
            root: (nodes.len() - 1) as NodeId,
            nodes,
            ws_cap: crate::frame::WS_CAP,
        }
    }

    /// The same documents with at most `n` consecutive structural
    /// whitespace bytes (default 16): for output that should be compact,
    /// so that a model fond of whitespace cannot spend its tokens on it.
    pub fn with_max_whitespace(mut self, n: u8) -> Grammar {
        self.ws_cap = n;
        self
    }

    pub(crate) fn typed(&self, n: NodeId) -> &Typed {
        match &self.nodes[n as usize] {
            Node::Typed(t) => t,
            _ => unreachable!("node {n} is not typed"),
        }
    }

    pub(crate) fn lits(&self, n: NodeId) -> &[Vec<u8>] {
        match &self.nodes[n as usize] {
            Node::Lits(l) => l,
            _ => unreachable!("node {n} is not a literal set"),
        }
    }
}

/// The nodes every grammar starts with: [`ANY`], [`NEVER`], [`TRUE`], [`FALSE`], [`NULL`].
pub(crate) fn base_nodes() -> Vec<Node> {
    vec![
        Node::Typed(Box::new(Typed::plain(T_ALL))),
        Node::Never,
        Node::Lits(vec![b"true".to_vec()]),
        Node::Lits(vec![b"false".to_vec()]),
        Node::Lits(vec![b"null".to_vec()]),
    ]
}
