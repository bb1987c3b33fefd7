//! The syntax of the names in a CDI spec: its kind (`vendor/class`), its device names and its
//! annotation keys (Kubernetes' qualified names), with the reference crate's rules.

use std::collections::BTreeMap;

/// The most bytes the keys and values of one annotations map may hold together.
pub const ANNOTATIONS_LIMIT: usize = 256 * 1024;
/// The most bytes of an annotation key's name (after its `prefix/`).
const KEY_NAME_LIMIT: usize = 63;
/// The most bytes of an annotation key's prefix.
const KEY_PREFIX_LIMIT: usize = 253;

/// What is wrong with a vendor, class or device name. Each message names the part at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameFault {
    /// A kind that is not two non-empty parts around one `/`.
    #[error("not vendor/class")]
    NotVendorClass,
    /// The part is empty.
    #[error("the {part} is empty")]
    Empty {
        /// `vendor`, `class` or `name`.
        part: &'static str,
    },
    /// The first character is not allowed there.
    #[error("the {part} {value:?} does not start with {allowed}")]
    Start {
        /// `vendor`, `class` or `name`.
        part: &'static str,
        /// The part.
        value: String,
        /// What it may start with.
        allowed: &'static str,
    },
    /// The last character is not a letter or digit.
    #[error("the {part} {value:?} does not end with a letter or digit")]
    End {
        /// `vendor`, `class` or `name`.
        part: &'static str,
        /// The part.
        value: String,
    },
    /// A character that the part may not hold.
    #[error(
        "the {part} {value:?} has {found:?}, which is not a letter, digit or one of {allowed}"
    )]
    Character {
        /// `vendor`, `class` or `name`.
        part: &'static str,
        /// The part.
        value: String,
        /// The first character not allowed.
        found: char,
        /// The punctuation allowed.
        allowed: &'static str,
    },
}

/// What the first character of a name part may be.
#[derive(Clone, Copy)]
enum First {
    Letter,
    LetterOrDigit,
}

impl First {
    fn allows(self, c: char) -> bool {
        match self {
            First::Letter => c.is_ascii_alphabetic(),
            First::LetterOrDigit => c.is_ascii_alphanumeric(),
        }
    }

    fn words(self) -> &'static str {
        match self {
            First::Letter => "a letter",
            First::LetterOrDigit => "a letter or digit",
        }
    }
}

/// Checks one part of a name: non-empty, its first character as `first` says, its last a
/// letter or digit, the ones between letters, digits or `punctuation`.
fn check_part(
    part: &'static str,
    value: &str,
    first: First,
    punctuation: &'static str,
) -> Result<(), NameFault> {
    let (Some(head), Some(last)) = (value.chars().next(), value.chars().last()) else {
        return Err(NameFault::Empty { part });
    };
    if !first.allows(head) {
        return Err(NameFault::Start {
            part,
            value: value.to_owned(),
            allowed: first.words(),
        });
    }
    if !last.is_ascii_alphanumeric() {
        return Err(NameFault::End {
            part,
            value: value.to_owned(),
        });
    }
    let inner = value
        .chars()
        .skip(1)
        .take(value.chars().count().saturating_sub(2));
    let mut bad = inner.filter(|c| !c.is_ascii_alphanumeric() && !punctuation.contains(*c));
    match bad.next() {
        Some(found) => Err(NameFault::Character {
            part,
            value: value.to_owned(),
            found,
            allowed: punctuation,
        }),
        None => Ok(()),
    }
}

/// The vendor and class of a kind, each checked: a letter first, a letter or digit last,
/// letters, digits, `-`, `_` and `.` between.
pub fn check_kind(kind: &str) -> Result<(&str, &str), NameFault> {
    let mut parts = kind.split('/');
    let (Some(vendor), Some(class), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(NameFault::NotVendorClass);
    };
    if vendor.is_empty() || class.is_empty() {
        return Err(NameFault::NotVendorClass);
    }
    check_part("vendor", vendor, First::Letter, "-_.")?;
    check_part("class", class, First::Letter, "-_.")?;
    Ok((vendor, class))
}

/// Checks a device name: a letter or digit first and last, letters, digits, `-`, `_`, `.` and
/// `:` between.
pub fn check_device_name(name: &str) -> Result<(), NameFault> {
    check_part("name", name, First::LetterOrDigit, "-_.:")
}

/// What is wrong with an annotations map.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AnnotationFault {
    /// A key that is not a Kubernetes qualified name (`[prefix/]name`).
    #[error("annotation key {key:?}: {why}")]
    Key {
        /// The key.
        key: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Keys and values larger than [`ANNOTATIONS_LIMIT`] together.
    #[error("annotations of {size} bytes, more than the {ANNOTATIONS_LIMIT} allowed")]
    TooLarge {
        /// Their size: the bytes of all keys and values.
        size: usize,
    },
}

/// Checks annotations: each key a Kubernetes qualified name (compared in lower case), all keys
/// and values within [`ANNOTATIONS_LIMIT`] bytes. Values are free.
pub fn check_annotations(annotations: &BTreeMap<String, String>) -> Result<(), AnnotationFault> {
    for key in annotations.keys() {
        if let Err(why) = check_key(&key.to_lowercase()) {
            return Err(AnnotationFault::Key {
                key: key.clone(),
                why,
            });
        }
    }
    let size = annotations
        .iter()
        .map(|(key, value)| key.len() + value.len())
        .sum();
    match size > ANNOTATIONS_LIMIT {
        true => Err(AnnotationFault::TooLarge { size }),
        false => Ok(()),
    }
}

/// Checks an annotation key, in lower case: an optional DNS subdomain prefix and `/`, then a
/// name of at most 63 letters, digits, `-`, `_` and `.`, a letter or digit first and last.
fn check_key(key: &str) -> Result<(), &'static str> {
    let mut parts = key.split('/');
    let (first, second, more) = (parts.next(), parts.next(), parts.next());
    let name = match (first, second, more) {
        (Some(name), None, _) => name,
        (Some(prefix), Some(name), None) => {
            check_prefix(prefix)?;
            name
        }
        _ => return Err("more than one '/'"),
    };
    let edges_ok = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    let inner_ok = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if name.is_empty() {
        Err("the name part is empty")
    } else if name.len() > KEY_NAME_LIMIT {
        Err("the name part is longer than 63 characters")
    } else if !edges_ok || !inner_ok {
        Err("the name part is not letters, digits, '-', '_' or '.' between a letter or digit first and last")
    } else {
        Ok(())
    }
}

/// Checks an annotation key's prefix (lower case): a DNS subdomain of at most 253 characters,
/// dot-separated labels of `a-z`, `0-9` and `-`, each with a letter or digit first and last.
fn check_prefix(prefix: &str) -> Result<(), &'static str> {
    if prefix.is_empty() {
        return Err("the prefix before '/' is empty");
    }
    if prefix.len() > KEY_PREFIX_LIMIT {
        return Err("the prefix is longer than 253 characters");
    }
    let lower_alphanumeric = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    let label_ok = |label: &str| {
        label.starts_with(lower_alphanumeric)
            && label.ends_with(lower_alphanumeric)
            && label.chars().all(|c| lower_alphanumeric(c) || c == '-')
    };
    match prefix.split('.').all(label_ok) {
        true => Ok(()),
        false => Err("the prefix is not a DNS subdomain (lower-case letters, digits, '-' and '.')"),
    }
}
