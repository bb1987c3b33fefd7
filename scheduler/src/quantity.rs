//! Byte quantities: Kubernetes quantity syntax in, human-readable sizes out.
//!
//! [`parse_quantity`] reads a Kubernetes resource quantity (`8Gi`, `8192Mi`, `8G`, `1.5Gi`,
//! `1e9`, `1073741824`) as an exact number of bytes: the arithmetic is done on the decimal digits,
//! never in floating point, so `1.5Gi` is exactly 1610612736 and `0.1Gi` (107374182.4 bytes) is
//! refused. [`format_bytes`] shows a number of bytes to people.

use std::borrow::Cow;
use std::fmt;

/// The largest power of two [`parse_quantity`] multiplies by in one pass (keeps a digit times
/// the multiplier plus the carry inside a `u64`).
const STEP_BITS: u32 = 30;

/// What every quantity error tells the user to write instead.
const ACCEPTED: &str = "write a whole number of bytes or a number with a Kubernetes unit \
     (Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E), like `8Gi`, `8192Mi` or `1.5Gi`";

/// A text that is not a memory quantity gpuplex accepts.
///
/// Its `Display` is one line that names the value (control characters escaped) and says what is
/// accepted, e.g. "`8GB` is not a memory quantity: `GB` is not a Kubernetes unit ...".
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{}` {}", shown(.value), .kind)]
pub struct QuantityError {
    /// The text as it was given.
    pub value: String,
    /// What is wrong with it.
    pub kind: QuantityErrorKind,
}

/// What is wrong with a memory quantity. `Display` gives the reason and what is accepted,
/// without the value, as a predicate ("is negative: write ...").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuantityErrorKind {
    /// The text is empty.
    Empty,
    /// The text is not a number followed by an optional unit (`Gi`, `1.2.3Gi`, `1 Gi`).
    Malformed,
    /// The number is followed by letters that are not a Kubernetes unit (`8GB`, `8gi`); the
    /// letters are kept.
    UnknownUnit(String),
    /// The number is negative.
    Negative,
    /// The quantity is zero bytes.
    Zero,
    /// The quantity is more than `u64::MAX` bytes.
    TooLarge,
    /// The quantity is not a whole number of bytes (`0.5`, `1m`, `0.1Gi`).
    NotWhole,
}

impl fmt::Display for QuantityErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantityErrorKind::Empty => write!(f, "is empty: {ACCEPTED}"),
            QuantityErrorKind::Malformed => write!(f, "is not a memory quantity: {ACCEPTED}"),
            QuantityErrorKind::UnknownUnit(unit) => write!(
                f,
                "is not a memory quantity: `{}` is not a Kubernetes unit (units are \
                 case-sensitive); {ACCEPTED}",
                shown(unit)
            ),
            QuantityErrorKind::Negative => write!(f, "is negative: {ACCEPTED}"),
            QuantityErrorKind::Zero => {
                write!(f, "is zero: memory must be at least 1 byte; {ACCEPTED}")
            }
            QuantityErrorKind::TooLarge => write!(
                f,
                "is too large: the most is {} bytes (just under 16Ei); {ACCEPTED}",
                u64::MAX
            ),
            QuantityErrorKind::NotWhole => write!(
                f,
                "is not a whole number of bytes: write a number and unit that come to whole \
                 bytes, like `8Gi`, `1536Mi` or `1.5Gi` (`m` means a thousandth, not mega)"
            ),
        }
    }
}

/// `text` for a one-line message: control characters and line breaks are escaped (`\n`,
/// `\u{2028}`), everything else is kept.
pub fn shown(text: &str) -> Cow<'_, str> {
    let escape = |c: char| c.is_control() || (c.is_whitespace() && c != ' ');
    if !text.chars().any(escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if escape(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The scale of a quantity's suffix: the number is multiplied by `2^pow2 × 10^pow10`.
#[derive(Clone, Copy)]
struct Scale {
    pow2: u32,
    pow10: i64,
}

/// The scale of a Kubernetes suffix: a binary unit, a decimal unit (including the fractional
/// `m`, `u` and `n`), or a decimal exponent (`e6`, `E-3`). `None` for anything else.
fn scale_of(suffix: &str) -> Option<Scale> {
    let binary = |pow2| Some(Scale { pow2, pow10: 0 });
    let decimal = |pow10| Some(Scale { pow2: 0, pow10 });
    match suffix {
        "Ki" => binary(10),
        "Mi" => binary(20),
        "Gi" => binary(30),
        "Ti" => binary(40),
        "Pi" => binary(50),
        "Ei" => binary(60),
        "n" => decimal(-9),
        "u" => decimal(-6),
        "m" => decimal(-3),
        "" => decimal(0),
        "k" => decimal(3),
        "M" => decimal(6),
        "G" => decimal(9),
        "T" => decimal(12),
        "P" => decimal(15),
        "E" => decimal(18),
        _ => {
            let exponent = suffix.strip_prefix(['e', 'E'])?;
            let (negative, digits) = match exponent.as_bytes().first()? {
                b'-' => (true, &exponent[1..]),
                b'+' => (false, &exponent[1..]),
                _ => (false, exponent),
            };
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            // Saturate: an exponent this large already makes any nonzero number too large
            // (or, negative, not whole), and zero stays zero.
            let magnitude = digits.bytes().fold(0i64, |acc, b| {
                (acc * 10 + i64::from(b - b'0')).min(1_000_000_000)
            });
            decimal(if negative { -magnitude } else { magnitude })
        }
    }
}

/// Parses a Kubernetes resource quantity as a whole, positive number of bytes.
///
/// Accepted: a number (`8`, `1.5`, `.5`, `8.`, optionally with a leading `+`) followed by
/// nothing (bytes), a binary unit (`Ki Mi Gi Ti Pi Ei`), a decimal unit (`k M G T P E`, and
/// `m u n` when the result is still whole, like `1000m`), or a decimal exponent (`1e9`,
/// `12E6`, `15e-1` is not whole). The result is exact. Refused, each with its own
/// [`QuantityErrorKind`]: empty text, malformed numbers, units Kubernetes does not know (`8GB`,
/// `8gi`; units are case-sensitive), negative numbers, zero, more than `u64::MAX` bytes, and
/// results that are not a whole number of bytes. Surrounding whitespace is not trimmed.
///
/// When several things are wrong, the first of: malformed (or empty, or unknown unit),
/// negative, zero, too large, not whole.
pub fn parse_quantity(text: &str) -> Result<u64, QuantityError> {
    let fail = |kind| QuantityError {
        value: text.to_string(),
        kind,
    };
    if text.is_empty() {
        return Err(fail(QuantityErrorKind::Empty));
    }
    let bytes = text.as_bytes();
    let digits_end = |from: usize| {
        from + bytes[from..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count()
    };
    let (negative, int_start) = match bytes[0] {
        b'-' => (true, 1),
        b'+' => (false, 1),
        _ => (false, 0),
    };
    let int_end = digits_end(int_start);
    let (frac_start, end) = if bytes.get(int_end) == Some(&b'.') {
        (int_end + 1, digits_end(int_end + 1))
    } else {
        (int_end, int_end)
    };
    let int_digits = &text[int_start..int_end];
    let frac_digits = &text[frac_start..end];
    if int_digits.is_empty() && frac_digits.is_empty() {
        return Err(fail(QuantityErrorKind::Malformed));
    }
    // `end` follows ASCII digits, a sign or a dot, so it is a char boundary.
    let suffix = &text[end..];
    let Some(scale) = scale_of(suffix) else {
        let unit_like = suffix.bytes().all(|b| b.is_ascii_alphabetic());
        return Err(fail(if unit_like {
            QuantityErrorKind::UnknownUnit(suffix.to_string())
        } else {
            QuantityErrorKind::Malformed
        }));
    };
    if negative {
        return Err(fail(QuantityErrorKind::Negative));
    }
    exact_bytes(int_digits, frac_digits, scale).map_err(fail)
}

/// `int.frac × 2^pow2 × 10^pow10` as a whole number of bytes, computed on the decimal digits.
fn exact_bytes(
    int_digits: &str,
    frac_digits: &str,
    scale: Scale,
) -> Result<u64, QuantityErrorKind> {
    // Little-endian decimal digits of the mantissa `int ++ frac`; the value is
    // `mantissa × 2^pow2 × 10^exp10`.
    let mut digits: Vec<u8> = int_digits
        .bytes()
        .chain(frac_digits.bytes())
        .rev()
        .map(|b| b - b'0')
        .collect();
    let frac_len = i64::try_from(frac_digits.len()).unwrap_or(i64::MAX);
    let mut exp10 = scale.pow10.saturating_sub(frac_len);
    while digits.last() == Some(&0) {
        digits.pop();
    }
    if digits.is_empty() {
        return Err(QuantityErrorKind::Zero);
    }
    let low_zeros = digits.iter().take_while(|&&d| d == 0).count();
    digits.drain(..low_zeros);
    exp10 = exp10.saturating_add(i64::try_from(low_zeros).unwrap_or(i64::MAX));

    let mut pow2 = scale.pow2;
    while pow2 > 0 {
        let step = pow2.min(STEP_BITS);
        pow2 -= step;
        let mut carry = 0u64;
        for digit in digits.iter_mut() {
            let cur = u64::from(*digit) * (1 << step) + carry;
            *digit = (cur % 10) as u8;
            carry = cur / 10;
        }
        while carry > 0 {
            digits.push((carry % 10) as u8);
            carry /= 10;
        }
    }

    // u64::MAX has 20 digits; a longer run of digits (no leading zeros) is larger.
    let value_of = |whole: &[u8]| -> Result<u64, QuantityErrorKind> {
        if whole.len() > 20 {
            return Err(QuantityErrorKind::TooLarge);
        }
        let value = whole
            .iter()
            .rev()
            .fold(0u128, |acc, &d| acc * 10 + u128::from(d));
        u64::try_from(value).map_err(|_| QuantityErrorKind::TooLarge)
    };
    if exp10 >= 0 {
        let len = i64::try_from(digits.len()).unwrap_or(i64::MAX);
        if len.saturating_add(exp10) > 20 {
            return Err(QuantityErrorKind::TooLarge);
        }
        // 0 <= exp10 <= 20 here.
        digits.splice(0..0, std::iter::repeat_n(0, exp10 as usize));
        return value_of(&digits);
    }
    let cut = usize::try_from(exp10.unsigned_abs()).unwrap_or(usize::MAX);
    if cut >= digits.len() {
        // Nonzero and below one byte.
        return Err(QuantityErrorKind::NotWhole);
    }
    let (fraction, whole) = digits.split_at(cut);
    let value = value_of(whole)?;
    if fraction.iter().any(|&d| d != 0) {
        return Err(QuantityErrorKind::NotWhole);
    }
    Ok(value)
}

/// Formats bytes for people, in the largest binary unit that keeps the number at or above 1:
/// `512 B`, `1.5 GiB`, `80 GiB`, with at most two decimals.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    if unit == 0 {
        return format!("{bytes} B");
    }
    let value = bytes as f64 / (1u64 << (10 * unit)) as f64;
    let text = format!("{value:.2}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text} {}", UNITS[unit])
}

#[cfg(test)]
mod format_tests {
    use super::format_bytes;

    #[test]
    fn formats_in_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1024), "1 KiB");
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
        assert_eq!(format_bytes(80 << 30), "80 GiB");
        assert_eq!(format_bytes(u64::MAX), "16 EiB");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;

    #[test]
    fn accepts_kubernetes_quantities_exactly() {
        let cases: &[(&str, u64)] = &[
            ("8Gi", 8 * GI),
            ("8192Mi", 8 * GI),
            ("8G", 8_000_000_000),
            ("1.5Gi", 1_610_612_736),
            ("1e9", 1_000_000_000),
            ("12E6", 12_000_000),
            ("1073741824", GI),
            ("1", 1),
            ("18446744073709551615", u64::MAX),
            ("1Ki", 1 << 10),
            ("1Mi", 1 << 20),
            ("1Ti", 1 << 40),
            ("1Pi", 1 << 50),
            ("1Ei", 1 << 60),
            ("15Ei", 15 << 60),
            ("1k", 1_000),
            ("1M", 1_000_000),
            ("1T", 1_000_000_000_000),
            ("1P", 1_000_000_000_000_000),
            ("1E", 1_000_000_000_000_000_000),
            ("18E", 18_000_000_000_000_000_000),
            (".5Ki", 512),
            ("0.25Gi", GI / 4),
            ("1.Gi", GI),
            ("+8Gi", 8 * GI),
            ("0008Gi", 8 * GI),
            ("8.000000000000000000000000000000Gi", 8 * GI),
            ("1000m", 1),
            ("1000000000n", 1),
            ("1e+3", 1_000),
            ("1e0", 1),
            ("10e-1", 1),
            ("1.25e3", 1_250),
            ("0.000000000000000000000001e24", 1),
            // 2^-60 written out exactly, times 2^60.
            (
                "0.000000000000000000867361737988403547205962240695953369140625Ei",
                1,
            ),
        ];
        for (text, bytes) in cases {
            assert_eq!(parse_quantity(text), Ok(*bytes), "{text}");
        }
    }

    #[test]
    fn refuses_what_kubernetes_or_memory_does_not_allow() {
        use QuantityErrorKind::*;
        let unit = |u: &str| UnknownUnit(u.to_string());
        let cases: &[(&str, QuantityErrorKind)] = &[
            ("", Empty),
            ("-1Gi", Negative),
            ("-0.5", Negative),
            ("8GB", unit("GB")),
            ("8gi", unit("gi")),
            ("8K", unit("K")),
            ("8KiB", unit("KiB")),
            ("1e", unit("e")),
            ("1.2.3Gi", Malformed),
            ("Gi", Malformed),
            ("1 Gi", Malformed),
            (" 8Gi", Malformed),
            ("8Gi ", Malformed),
            (".", Malformed),
            ("-", Malformed),
            ("+", Malformed),
            ("--1", Malformed),
            ("1e3.5", Malformed),
            ("1ee3", Malformed),
            ("1e+", Malformed),
            ("8 Gi\n", Malformed),
            ("0x10", Malformed),
            ("８Gi", Malformed),
            ("0", Zero),
            ("0Gi", Zero),
            ("0.000", Zero),
            ("0e999", Zero),
            ("0.5", NotWhole),
            ("1m", NotWhole),
            ("0.1Gi", NotWhole),
            ("1n", NotWhole),
            ("15e-1", NotWhole),
            ("1e-999999999999999999999", NotWhole),
            (
                "1.0000000000000000000000000000000000000000000000000000000000000001Ei",
                NotWhole,
            ),
            ("20Ei", TooLarge),
            ("16Ei", TooLarge),
            ("99999999999999999999", TooLarge),
            ("18446744073709551616", TooLarge),
            ("1e20", TooLarge),
            ("19E", TooLarge),
            ("1e999999999999999999999", TooLarge),
            ("99999999999999999999.5", TooLarge),
        ];
        for (text, kind) in cases {
            let err = parse_quantity(text).expect_err(text);
            assert_eq!(&err.kind, kind, "{text}");
            assert_eq!(err.value, *text);
            let message = err.to_string();
            assert!(!message.contains('\n'), "{message}");
            assert!(
                message.starts_with(&format!("`{}` ", shown(text))),
                "{message}"
            );
            assert!(message.contains("like `8Gi`"), "{message}");
        }
    }

    #[test]
    fn messages_name_the_value_and_the_units() {
        let message = parse_quantity("8GB").unwrap_err().to_string();
        assert_eq!(
            message,
            "`8GB` is not a memory quantity: `GB` is not a Kubernetes unit (units are \
             case-sensitive); write a whole number of bytes or a number with a Kubernetes unit \
             (Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E), like `8Gi`, `8192Mi` or `1.5Gi`"
        );
        let message = parse_quantity("20Ei").unwrap_err().to_string();
        assert!(message.starts_with("`20Ei` is too large: the most is 18446744073709551615 bytes"));
        let message = parse_quantity("0").unwrap_err().to_string();
        assert!(message.starts_with("`0` is zero"), "{message}");
        let message = parse_quantity("1\n2\u{2028}").unwrap_err().to_string();
        assert!(message.starts_with("`1\\n2\\u{2028}` "), "{message}");
    }

    /// The exact value of `int.frac` times `2^pow2 × 10^pow10`, by rational arithmetic, with the
    /// error order of [`parse_quantity`].
    fn oracle(int: u64, frac: &str, pow2: u32, pow10: i32) -> Result<u64, QuantityErrorKind> {
        let mut numerator =
            u128::from(int) * 10u128.pow(frac.len() as u32) + frac.parse::<u128>().unwrap_or(0);
        let mut denominator = 10u128.pow(frac.len() as u32);
        numerator <<= pow2;
        if pow10 >= 0 {
            numerator *= 10u128.pow(pow10 as u32);
        } else {
            denominator *= 10u128.pow(pow10.unsigned_abs());
        }
        if numerator == 0 {
            Err(QuantityErrorKind::Zero)
        } else if numerator / denominator > u128::from(u64::MAX) {
            Err(QuantityErrorKind::TooLarge)
        } else if numerator % denominator != 0 {
            Err(QuantityErrorKind::NotWhole)
        } else {
            Ok((numerator / denominator) as u64)
        }
    }

    fn unit() -> impl Strategy<Value = (String, u32, i32)> {
        const UNITS: [(&str, u32, i32); 16] = [
            ("", 0, 0),
            ("Ki", 10, 0),
            ("Mi", 20, 0),
            ("Gi", 30, 0),
            ("Ti", 40, 0),
            ("Pi", 50, 0),
            ("Ei", 60, 0),
            ("n", 0, -9),
            ("u", 0, -6),
            ("m", 0, -3),
            ("k", 0, 3),
            ("M", 0, 6),
            ("G", 0, 9),
            ("T", 0, 12),
            ("P", 0, 15),
            ("E", 0, 18),
        ];
        prop_oneof![
            3 => prop::sample::select(&UNITS[..]).prop_map(|(u, p2, p10)| (u.to_string(), p2, p10)),
            1 => (prop::bool::ANY, -12i32..=12).prop_map(|(upper, p10)| {
                (format!("{}{p10}", if upper { 'E' } else { 'e' }), 0, p10)
            }),
        ]
    }

    proptest! {
        #[test]
        fn never_panics_and_errors_are_one_line(text in prop_oneof![
            any::<String>(),
            "[-+0-9.eEkKMGTPimnu \n]{0,40}",
        ]) {
            if let Err(err) = parse_quantity(&text) {
                prop_assert!(!err.to_string().contains('\n'));
            }
        }

        #[test]
        fn number_and_unit_give_the_exact_value(
            int in prop_oneof![0u64..2_000, 0u64..1_000_000_000],
            frac in "[0-9]{0,4}",
            dot in prop::bool::ANY,
            (suffix, pow2, pow10) in unit(),
        ) {
            let text = if frac.is_empty() && !dot {
                format!("{int}{suffix}")
            } else {
                format!("{int}.{frac}{suffix}")
            };
            let expected = oracle(int, &frac, pow2, pow10);
            prop_assert_eq!(parse_quantity(&text).map_err(|e| e.kind), expected, "{}", text);
        }

        #[test]
        fn whole_numbers_are_bytes(bytes in 1u64..) {
            prop_assert_eq!(parse_quantity(&bytes.to_string()), Ok(bytes));
        }

        #[test]
        fn gibibytes_format_back(n in 1u64..1024) {
            let bytes = parse_quantity(&format!("{n}Gi")).unwrap();
            prop_assert_eq!(format_bytes(bytes), format!("{n} GiB"));
        }
    }
}
