//! [`StreamDecoder`]: turning ids into text one at a time, for streaming output.
//!
//! A byte-level BPE token can end in the middle of a UTF-8 character (Han, emoji), so
//! printing each token's decode on its own would show replacement characters that the
//! full decode does not have. The decoder buffers bytes and releases only complete
//! characters. Bytes that can never become valid (a stray continuation byte, 0xFF) are
//! released as U+FFFD at once, grouped exactly as `String::from_utf8_lossy` groups
//! them, so the concatenated stream equals `decode` of all ids.

use crate::Tokenizer;

/// Incremental detokeniser over a borrowed tokenizer.
pub struct StreamDecoder<'a> {
    tokenizer: &'a dyn Tokenizer,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder with nothing buffered.
    pub fn new(tokenizer: &'a dyn Tokenizer) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// Adds one token and returns the text it completes (possibly empty). An id the
    /// tokenizer does not know counts as one invalid byte (U+FFFD).
    pub fn push(&mut self, id: u32) -> String {
        match self.tokenizer.token_bytes(id) {
            Some(bytes) => self.pending.extend_from_slice(&bytes),
            None => self.pending.push(0xFF),
        }
        self.drain_complete()
    }

    /// Returns whatever is still buffered (an incomplete character becomes U+FFFD) and
    /// resets the decoder.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// True if bytes of an unfinished character are buffered.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just validated, so this cannot fail.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid]).unwrap_or(""),
                    );
                    start += valid;
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            start += bad;
                        }
                        // An incomplete character at the end: keep it for later.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
