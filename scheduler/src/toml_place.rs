//! Where a TOML error is, for one-line messages: toml's own report spans several lines with a
//! snippet of the document; gpuplex says `line 7 (scheduler.slice): <what is wrong>`.

/// The place and text of a TOML error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TomlPlace {
    /// The line of the error, from 1, when toml knows the place.
    pub line: Option<usize>,
    /// The key path there (`scheduler.slice`, `container.demand`), when the layout is plain.
    pub key: Option<String>,
    /// toml's message, on one line.
    pub message: String,
}

impl TomlPlace {
    /// Where `error`, raised while reading `text`, is.
    pub fn of(text: &str, error: &toml::de::Error) -> TomlPlace {
        let span = error.span();
        TomlPlace {
            line: span.as_ref().map(|s| line_of(text, s.start)),
            key: span.and_then(|s| key_at(text, s.start)),
            message: error.message().trim_end().replace('\n', "; "),
        }
    }
}

/// The line (from 1) of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    let offset = offset.min(text.len());
    text.as_bytes()[..offset]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// The key path at a byte offset, read from the nearest table header above it and the key of its
/// line: `scheduler.slice`. A best effort for the plain `key = value` layout; `None` when the
/// line has no key or the text around it is not that simple.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next().unwrap_or("");
    let simple = |k: &str| {
        !k.is_empty()
            && k.split('.').all(|part| {
                let part = part.trim();
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            })
    };
    let normal = |k: &str| k.split('.').map(str::trim).collect::<Vec<_>>().join(".");
    let header = |l: &str| {
        let l = l.trim();
        let inner = l.strip_prefix("[[").and_then(|r| r.split("]]").next());
        let inner = inner.or_else(|| l.strip_prefix('[').and_then(|r| r.split(']').next()));
        inner.filter(|k| simple(k)).map(normal)
    };
    if line.trim_start().starts_with('[') {
        return header(line);
    }
    let (key, _) = line.split_once('=')?;
    if !simple(key.trim()) {
        return None;
    }
    let table = text[..start]
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('['));
    match table {
        Some(l) => Some(format!("{}.{}", header(l)?, normal(key))),
        None => Some(normal(key)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_paths_are_found_in_plain_layouts() {
        let text = "top = 1\n[a.b]\nc = 2\n[[d]]\n e . f = 3\n[x y]\nk = 1\n";
        let at = |needle: &str| key_at(text, text.find(needle).unwrap());
        assert_eq!(at("1"), Some("top".into()));
        assert_eq!(at("a.b"), Some("a.b".into()));
        assert_eq!(at("2"), Some("a.b.c".into()));
        assert_eq!(at("3"), Some("d.e.f".into()));
        assert_eq!(at("k ="), None, "under a table name that is not plain");
        assert_eq!(key_at("x = \"a\nb\"", 7), None);
    }

    #[test]
    fn line_numbers_count_from_one() {
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
        assert_eq!(line_of("a\nb\nc", 4), 3);
        assert_eq!(line_of("a", 99), 1);
    }

    #[test]
    fn a_toml_error_becomes_one_located_line() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct S {
            slice: String,
        }
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Doc {
            scheduler: S,
        }
        let text = "# c\n[scheduler]\nslise = \"1s\"\n";
        let e = toml::from_str::<Doc>(text).unwrap_err();
        let place = TomlPlace::of(text, &e);
        assert_eq!(place.line, Some(3));
        assert_eq!(place.key.as_deref(), Some("scheduler.slise"));
        assert!(
            place.message.contains("unknown field `slise`"),
            "{}",
            place.message
        );
        assert!(!place.message.contains('\n'));
    }
}
