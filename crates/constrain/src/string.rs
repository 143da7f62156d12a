//! Byte-level lexers for string contents and numbers.

/// Where a string's contents stand (after the opening quote).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct StrSt {
    mode: u8,
    /// UTF-8 continuation bytes still due, or hex digits read.
    n: u8,
    /// UTF-8: range class of the next byte; hex: 1 for the low half of a pair.
    cls: u8,
    /// Hex digits read so far.
    val: u16,
}

const NORMAL: u8 = 0;
const ESC: u8 = 1;
const HEX: u8 = 2;
const PAIR_BS: u8 = 3;
const PAIR_U: u8 = 4;
const UTF8: u8 = 5;

/// Allowed ranges for the next UTF-8 continuation byte (overlongs and surrogates excluded).
const CONT: [(u8, u8); 5] = [
    (0x80, 0xBF),
    (0xA0, 0xBF),
    (0x80, 0x9F),
    (0x90, 0xBF),
    (0x80, 0x8F),
];

impl StrSt {
    /// Between characters, outside any escape or UTF-8 sequence.
    pub(crate) fn is_normal(self) -> bool {
        self.mode == NORMAL
    }
}

/// A byte that stands for itself inside a string (printable ASCII but `"` and `\`).
pub(crate) fn is_plain(b: u8) -> bool {
    (0x20..=0x7F).contains(&b) && b != b'"' && b != b'\\'
}

pub(crate) enum StrStep {
    /// The byte continues the string; `bool` is true when it starts a new character.
    Char(StrSt, bool),
    /// The byte is the closing quote.
    Close,
    Fail,
}

fn utf8(n: u8, cls: u8) -> StrSt {
    StrSt {
        mode: UTF8,
        n,
        cls,
        val: 0,
    }
}

fn mode(mode: u8) -> StrSt {
    StrSt {
        mode,
        ..StrSt::default()
    }
}

fn hex_digit(b: u8) -> Option<u16> {
    match b {
        b'0'..=b'9' => Some((b - b'0') as u16),
        b'a'..=b'f' => Some((b - b'a' + 10) as u16),
        b'A'..=b'F' => Some((b - b'A' + 10) as u16),
        _ => None,
    }
}

/// Whether some completion of `n` hex digits `val` is allowed: a low surrogate
/// when `low`, otherwise anything but a low surrogate (a high one starts a pair).
fn hex_ok(val: u16, n: u8, low: bool) -> bool {
    let shift = 4 * (4 - n as u32);
    let lo = (val as u32) << shift;
    let hi = lo + (1u32 << shift) - 1;
    let inside = lo >= 0xDC00 && hi <= 0xDFFF;
    let overlaps = lo <= 0xDFFF && hi >= 0xDC00;
    if low { overlaps } else { !inside }
}

/// Steps the string lexer by one byte.
pub(crate) fn str_step(s: StrSt, b: u8) -> StrStep {
    match s.mode {
        NORMAL => match b {
            b'"' => StrStep::Close,
            b'\\' => StrStep::Char(mode(ESC), true),
            0x20..=0x7F => StrStep::Char(s, true),
            0xC2..=0xDF => StrStep::Char(utf8(1, 0), true),
            0xE0 => StrStep::Char(utf8(2, 1), true),
            0xED => StrStep::Char(utf8(2, 2), true),
            0xE1..=0xEF => StrStep::Char(utf8(2, 0), true),
            0xF0 => StrStep::Char(utf8(3, 3), true),
            0xF1..=0xF3 => StrStep::Char(utf8(3, 0), true),
            0xF4 => StrStep::Char(utf8(3, 4), true),
            _ => StrStep::Fail,
        },
        UTF8 => {
            let (lo, hi) = CONT[s.cls as usize];
            if b < lo || b > hi {
                StrStep::Fail
            } else if s.n == 1 {
                StrStep::Char(mode(NORMAL), false)
            } else {
                StrStep::Char(utf8(s.n - 1, 0), false)
            }
        }
        ESC => match b {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                StrStep::Char(mode(NORMAL), false)
            }
            b'u' => StrStep::Char(mode(HEX), false),
            _ => StrStep::Fail,
        },
        HEX => {
            let Some(h) = hex_digit(b) else {
                return StrStep::Fail;
            };
            let val = (s.val << 4) | h;
            let n = s.n + 1;
            let low = s.cls == 1;
            if !hex_ok(val, n, low) {
                StrStep::Fail
            } else if n < 4 {
                StrStep::Char(
                    StrSt {
                        mode: HEX,
                        n,
                        cls: s.cls,
                        val,
                    },
                    false,
                )
            } else if !low && (0xD800..=0xDBFF).contains(&val) {
                StrStep::Char(mode(PAIR_BS), false)
            } else {
                StrStep::Char(mode(NORMAL), false)
            }
        }
        PAIR_BS if b == b'\\' => StrStep::Char(mode(PAIR_U), false),
        PAIR_U if b == b'u' => StrStep::Char(
            StrSt {
                mode: HEX,
                n: 0,
                cls: 1,
                val: 0,
            },
            false,
        ),
        _ => StrStep::Fail,
    }
}

/// Where a number stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum NumSt {
    Start,
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

/// Steps the number lexer; `None` when `b` cannot continue the number.
pub(crate) fn num_step(st: NumSt, b: u8, integer: bool) -> Option<NumSt> {
    use NumSt::*;
    let digit = b.is_ascii_digit();
    match st {
        Start if b == b'-' => Some(Minus),
        Start | Minus if b == b'0' => Some(Zero),
        Start | Minus | Int if digit => Some(Int),
        Zero | Int if b == b'.' && !integer => Some(Dot),
        Zero | Int | Frac if (b == b'e' || b == b'E') && !integer => Some(Exp),
        Dot | Frac if digit => Some(Frac),
        Exp if b == b'+' || b == b'-' => Some(ExpSign),
        Exp | ExpSign | ExpDigits if digit => Some(ExpDigits),
        _ => None,
    }
}

/// Whether the number read so far is complete.
pub(crate) fn num_complete(st: NumSt) -> bool {
    matches!(
        st,
        NumSt::Zero | NumSt::Int | NumSt::Frac | NumSt::ExpDigits
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lex(bytes: &[u8]) -> Option<bool> {
        let mut s = StrSt::default();
        for (i, &b) in bytes.iter().enumerate() {
            match str_step(s, b) {
                StrStep::Char(s2, _) => s = s2,
                StrStep::Close => return (i + 1 == bytes.len()).then_some(true),
                StrStep::Fail => return None,
            }
        }
        Some(false)
    }

    #[test]
    fn strings() {
        assert_eq!(lex(b"abc\""), Some(true));
        assert_eq!(lex("é€😀\"".as_bytes()), Some(true));
        assert_eq!(lex(b"\\u00e9\\n\\\"\""), Some(true));
        assert_eq!(lex(b"\\ud83d\\ude00\""), Some(true));
        assert_eq!(lex(b"\\ud83d\""), None, "lone high surrogate");
        assert_eq!(lex(b"\\udc"), None, "lone low surrogate rejected early");
        assert_eq!(lex(b"\\ud83d\\u00"), None, "high surrogate needs a low one");
        assert_eq!(lex(b"\\x"), None);
        assert_eq!(lex(b"\xff"), None);
        assert_eq!(lex(b"\xc0\x80"), None, "overlong");
        assert_eq!(lex(b"\xe0\x80"), None, "overlong");
        assert_eq!(lex(b"\xed\xa0"), None, "surrogate");
        assert_eq!(lex(b"\x80"), None, "stray continuation");
        assert_eq!(lex(b"\xe2\x82"), Some(false));
        assert_eq!(lex(b"a\nb"), None);
    }

    #[test]
    fn numbers() {
        let ok = |s: &str, int: bool| {
            let mut st = NumSt::Start;
            for &b in s.as_bytes() {
                match num_step(st, b, int) {
                    Some(n) => st = n,
                    None => return false,
                }
            }
            num_complete(st)
        };
        for s in ["0", "-0", "12", "1.5", "2.5e-3", "1E+10", "-0.0e0"] {
            assert!(ok(s, false), "{s}");
        }
        for s in ["01", "-", "1.", ".5", "1e", "1e+", "+1", "--1"] {
            assert!(!ok(s, false), "{s}");
        }
        assert!(ok("-12", true));
        assert!(!ok("1.5", true));
        assert!(!ok("1e3", true));
    }
}
