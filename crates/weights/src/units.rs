//! Byte sizes as people type them (`40GB`, `512MiB`, `1.5TB`, `4096`) and as
//! the tools print them.
//!
//! Decimal suffixes (`kB`/`KB`, `MB`, `GB`, `TB`) are powers of 1000 and
//! binary ones (`KiB`, `MiB`, `GiB`, `TiB`) powers of 1024, as disk vendors
//! and `df -H` / `df -h` use them; a bare `K`/`M`/`G`/`T` is decimal too. A
//! plain number is bytes.

/// Parses a byte size. The error says what was wrong with the text.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    if num.is_empty() {
        return Err(format!(
            "{text:?}: expected a number such as 40GB or 512MiB"
        ));
    }
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{text:?}: {num:?} is not a number"))?;
    let factor: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB)"
            ));
        }
    };
    let bytes = value * factor;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{text:?}: too large"));
    }
    Ok(bytes.round() as u64)
}

/// `63.2 MB`, `40.0 GB`, `512 B`: decimal units, three significant figures.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["kB", "MB", "GB", "TB", "PB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if v < 1000.0 {
            break;
        }
        v /= 1000.0;
        unit = u;
    }
    if v >= 100.0 {
        format!("{v:.0} {unit}")
    } else if v >= 10.0 {
        format!("{v:.1} {unit}")
    } else {
        format!("{v:.2} {unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_decimal_binary_and_plain() {
        assert_eq!(parse_size("40GB"), Ok(40_000_000_000));
        assert_eq!(parse_size("40 gb"), Ok(40_000_000_000));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5TB"), Ok(1_500_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("8G"), Ok(8_000_000_000));
        assert_eq!(parse_size("2KiB"), Ok(2048));
        assert_eq!(parse_size("3kB"), Ok(3000));
    }

    #[test]
    fn rejects_with_reason() {
        assert!(parse_size("").unwrap_err().contains("expected a number"));
        assert!(parse_size("GB").unwrap_err().contains("expected a number"));
        assert!(parse_size("40XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("1.2.3GB").unwrap_err().contains("not a number"));
        assert!(parse_size("1e400").is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(63_200_000), "63.2 MB");
        assert_eq!(format_bytes(40_000_000_000), "40.0 GB");
        assert_eq!(format_bytes(1_234_000), "1.23 MB");
        assert_eq!(format_bytes(999_999), "1000 kB");
    }
}
