//! Byte quantities: Kubernetes quantity syntax in, human-readable sizes out.

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
