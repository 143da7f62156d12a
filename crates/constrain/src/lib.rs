//! JSON-constrained decoding.
//!
//! * [`Grammar`]: what a document must be — any JSON object
//!   ([`Grammar::json_object`]) or a JSON-schema subset
//!   ([`Grammar::from_schema`]).
//! * [`Matcher`]: a byte-level position in a document; [`Matcher::feed`]
//!   refuses bytes that cannot continue a valid document.
//! * [`TokenTrie`]: the vocabulary as a byte trie; [`TokenTrie::allowed`]
//!   computes which tokens may come next from a matcher.
//!
//! Structural whitespace is capped at 16 consecutive bytes (fewer with
//! [`Grammar::with_max_whitespace`]), and nothing may
//! follow the top-level value, so generation always terminates.

#![forbid(unsafe_code)]

mod frame;
mod grammar;
mod matcher;
mod schema;
mod string;
mod trie;

pub use grammar::Grammar;
pub use matcher::Matcher;
pub use schema::SchemaError;
pub use trie::TokenTrie;
