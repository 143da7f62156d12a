//! Rendered prompts as trusted/untrusted segments, and their encoding to ids.
//!
//! A prompt mixes template markup, whose special-token spellings must become special
//! ids, with caller content, whose must not. Rendering to one string would lose that
//! distinction, so renderers produce [`Segment`]s and only [`encode_segments`] decides
//! how each is tokenized.

use fathom_tokenizer::Tokenizer;

/// A piece of a rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Template markup: special-token spellings are recognised as specials.
    Trusted(String),
    /// Caller content: encoded as ordinary text.
    Text(String),
}

impl Segment {
    /// The segment's text.
    pub fn as_str(&self) -> &str {
        match self {
            Segment::Trusted(s) | Segment::Text(s) => s,
        }
    }
}

/// Appends segments, merging neighbours of the same kind.
///
/// Merging matters for ids: the pre-tokenizer may join characters across a boundary
/// between two `Text` pieces, and the reference encodes the rendered string in one go.
#[derive(Debug, Default)]
pub struct SegmentWriter {
    segments: Vec<Segment>,
}

impl SegmentWriter {
    /// Appends template markup.
    pub fn trusted(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        match self.segments.last_mut() {
            Some(Segment::Trusted(t)) => t.push_str(s),
            _ => self.segments.push(Segment::Trusted(s.to_string())),
        }
    }

    /// Appends caller content.
    pub fn text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        match self.segments.last_mut() {
            Some(Segment::Text(t)) => t.push_str(s),
            _ => self.segments.push(Segment::Text(s.to_string())),
        }
    }

    /// The segments written so far.
    pub fn finish(self) -> Vec<Segment> {
        self.segments
    }
}

/// The prompt as one string (for display and logging; loses trust information).
pub fn segments_to_string(segments: &[Segment]) -> String {
    segments.iter().map(Segment::as_str).collect()
}

/// Encodes segments: `Trusted` with specials recognised, `Text` as ordinary text.
/// Adjacent segments of one kind are joined first so ids do not depend on how a
/// renderer happened to split its output.
pub fn encode_segments(tokenizer: &dyn Tokenizer, segments: &[Segment]) -> Vec<u32> {
    let mut ids = Vec::new();
    let mut i = 0;
    while i < segments.len() {
        let trusted = matches!(segments[i], Segment::Trusted(_));
        let mut joined = String::new();
        while i < segments.len() && matches!(segments[i], Segment::Trusted(_)) == trusted {
            joined.push_str(segments[i].as_str());
            i += 1;
        }
        if trusted {
            ids.extend(tokenizer.encode_trusted(&joined));
        } else {
            ids.extend(tokenizer.encode(&joined));
        }
    }
    ids
}
