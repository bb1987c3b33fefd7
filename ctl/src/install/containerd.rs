//! gpuplex's runtime entry in containerd's `config.toml`, added and removed as text: the pure
//! functions [`edit`] and [`remove`] (and [`file_version`]), and the plans `gpuplexctl install
//! containerd` and `uninstall containerd` carry out with them ([`plan`]).
//!
//! The entry is exactly the table of the shipped snippet for the file's config version
//! (`config/containerd/config-v2.toml` or `config-v3.toml`, built into the binary), edited in
//! with `toml_edit` so that everything else in the file (comments, order, quoting, blank lines)
//! stays as the operator wrote it. A new entry goes at the end of the file, where the documented
//! `cat config-v2.toml >> config.toml` put it; an entry the operator changed is replaced in its
//! place. One more table may come with it: containerd 1.6 and 1.7 drop their built-in `runc`
//! runtime as soon as a config names any runtime, and their CRI plugin then fails to load, so in
//! a version 2 file that names no runtime of its own `runc` is named too, as containerd's default
//! names it, marked as gpuplexctl's so that [`remove`] takes it away again.

use std::fmt::Write as _;

use toml_edit::{DocumentMut, Item, Table, TableLike, TomlError, Value};

mod plan;

pub use plan::{plan_install, plan_uninstall};

/// The snippet for containerd 1.6 and 1.7 (config `version = 2`).
pub const SNIPPET_V2: &str = include_str!("../../../config/containerd/config-v2.toml");
/// The snippet for containerd 2.x (config `version = 3`).
pub const SNIPPET_V3: &str = include_str!("../../../config/containerd/config-v3.toml");

/// The runtime's name in the CRI plugin's `runtimes` table (Kubernetes' RuntimeClass handler).
pub const RUNTIME: &str = "gpuplex";

/// What to run after a change.
pub const RESTART: &str = "restart containerd: systemctl restart containerd";

/// The first line of the comment above each table gpuplexctl adds.
const MARK: &str = "# Added by `gpuplexctl install containerd`";

/// The `runc` runtime as containerd 1.6 and 1.7 name it by default, added with gpuplex's entry
/// to a version 2 config that names no runtime.
const RUNC_ENTRY: &str = "[runc]\n  runtime_type = \"io.containerd.runc.v2\"\n";

/// A containerd config version gpuplex edits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    /// `version = 2`: containerd 1.6 and 1.7.
    V2,
    /// `version = 3`: containerd 2.x.
    V3,
}

impl Version {
    /// The number the config's `version` key holds.
    pub fn number(self) -> i64 {
        match self {
            Version::V2 => 2,
            Version::V3 => 3,
        }
    }

    /// The shipped snippet for this version.
    pub fn snippet(self) -> &'static str {
        match self {
            Version::V2 => SNIPPET_V2,
            Version::V3 => SNIPPET_V3,
        }
    }

    /// Where this version keeps the CRI runtimes, by table.
    pub fn runtimes_path(self) -> [&'static str; 4] {
        match self {
            Version::V2 => [
                "plugins",
                "io.containerd.grpc.v1.cri",
                "containerd",
                "runtimes",
            ],
            Version::V3 => [
                "plugins",
                "io.containerd.cri.v1.runtime",
                "containerd",
                "runtimes",
            ],
        }
    }

    /// The config version a containerd reads, from the output of `containerd --version`
    /// (`containerd github.com/containerd/containerd 1.6.20~ds1 ...`, `... v2.0.0 ...`): 1.x
    /// reads version 2, 2.x version 3. `Err` says what was found instead.
    pub fn of_containerd(version_output: &str) -> Result<Version, String> {
        let release = version_output.split_whitespace().skip(1).find_map(|word| {
            let word = word.strip_prefix('v').unwrap_or(word);
            let (major, rest) = word.split_once('.')?;
            (!major.is_empty() && major.bytes().all(|b| b.is_ascii_digit()) && !rest.is_empty())
                .then(|| (major.to_string(), word.to_string()))
        });
        match release {
            Some((major, _)) if major == "1" => Ok(Version::V2),
            Some((major, _)) if major == "2" => Ok(Version::V3),
            Some((_, release)) => Err(format!(
                "containerd {release}, whose config version gpuplex does not know"
            )),
            None => Err(format!(
                "no release number in `{}`",
                version_output.lines().next().unwrap_or("").trim()
            )),
        }
    }
}

/// Why a config is not edited. Each is one line; the caller names the file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// It is not TOML.
    #[error("line {line}, column {column}: {message}")]
    Parse {
        /// From 1.
        line: usize,
        /// From 1, in characters.
        column: usize,
        /// toml_edit's message, on one line.
        message: String,
    },
    /// `version` holds something else than 2 or 3.
    #[error("`version = {0}` is not a config version gpuplex edits: 2 (containerd 1.6, 1.7) or 3 (containerd 2.x)")]
    Version(String),
    /// Settings without `version`: containerd reads it as version 1.
    #[error("it has settings but no `version`, so containerd reads it as config version 1, which gpuplex does not edit: convert it to version 2 (containerd 1.x; plugins named in full, as `containerd config default` shows) or 3 (containerd 2.x: `containerd config migrate`)")]
    NoVersion,
    /// The file says one version and the edit was asked for the other.
    #[error("it says `version = {found}`, not {wanted}")]
    Mismatch {
        /// The file's version.
        found: i64,
        /// The version asked for.
        wanted: i64,
    },
    /// A table on the way to the entry is something else.
    #[error("`{key}` is {what}, not a [table]: gpuplex's runtime goes in [{key}.gpuplex]; write it as a [table] and run this again")]
    NotATable {
        /// The key, dotted.
        key: String,
        /// What it is instead.
        what: &'static str,
    },
    /// What the edit made did not read back as it should (a bug; nothing is written).
    #[error("the edited config does not read back with gpuplex's runtime as shipped ({0}); please report this")]
    ReadBack(String),
}

/// What [`edit`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edit {
    /// The new text; the same bytes when nothing changed.
    pub text: String,
    /// What became of gpuplex's entry.
    pub entry: Entry,
    /// Whether the `runc` runtime was named too (see the module's doc).
    pub runc_added: bool,
    /// Whether `version = N` was written into a file that had none.
    pub version_added: bool,
}

impl Edit {
    /// Whether the text changed.
    pub fn changed(&self) -> bool {
        self.entry != Entry::Kept || self.runc_added || self.version_added
    }
}

/// What became of gpuplex's runtime entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// There was none: added.
    Added,
    /// There was one that differs from the snippet's: replaced with it.
    Updated,
    /// There was the snippet's already.
    Kept,
}

/// The config version of a config's text: `Some` from its `version` key, `None` when it has
/// no settings at all (empty, or comments only: containerd's defaults, whatever the version).
pub fn file_version(text: &str) -> Result<Option<Version>, ConfigError> {
    version_of(&parse(text)?)
}

/// `text` with gpuplex's runtime entry for `version`, added or made what the snippet says,
/// and nothing else changed. A text with no settings gets `version = N` first; one that says
/// another version is refused.
pub fn edit(text: &str, version: Version) -> Result<Edit, ConfigError> {
    let mut doc = parse(text)?;
    let edit = match version_of(&doc)? {
        Some(found) if found != version => {
            return Err(ConfigError::Mismatch {
                found: found.number(),
                wanted: version.number(),
            })
        }
        Some(_) => {
            let (entry, runc_added) = add_entries(&mut doc, version)?;
            let text = if entry == Entry::Kept && !runc_added {
                text.to_string()
            } else {
                doc.to_string()
            };
            Edit {
                text,
                entry,
                runc_added,
                version_added: false,
            }
        }
        None => {
            // No settings: the operator's comments stay first, then what containerd needs.
            let mut fresh = DocumentMut::new();
            fresh.insert("version", toml_edit::value(version.number()));
            let (entry, runc_added) = add_entries(&mut fresh, version)?;
            let mut new = text.to_string();
            if !new.is_empty() && !new.ends_with('\n') {
                new.push('\n');
            }
            if !new.trim().is_empty() {
                new.push('\n');
            }
            new.push_str(&fresh.to_string());
            Edit {
                text: new,
                entry,
                runc_added,
                version_added: true,
            }
        }
    };
    check_read_back(&edit.text, version)?;
    Ok(edit)
}

/// `text` without gpuplex's runtime entry (under either version's CRI plugin), and without the
/// `runc` runtime [`edit`] named with it while no other runtime is named; the same bytes when
/// there is neither.
pub fn remove(text: &str) -> Result<String, ConfigError> {
    let mut doc = parse(text)?;
    let mut changed = false;
    for version in [Version::V2, Version::V3] {
        let Some(runtimes) = table_like_at_mut(doc.as_table_mut(), &version.runtimes_path()) else {
            continue;
        };
        changed |= runtimes.remove(RUNTIME).is_some();
        let ours = runtimes.get("runc").is_some_and(is_added_runc);
        if ours && runtimes.iter().all(|(key, _)| key == "runc") {
            runtimes.remove("runc");
            changed = true;
        }
    }
    Ok(if changed {
        doc.to_string()
    } else {
        text.to_string()
    })
}

/// Whether `text` holds gpuplex's runtime entry, under either version's CRI plugin.
pub fn has_entry(text: &str) -> Result<bool, ConfigError> {
    let doc = parse(text)?;
    Ok([Version::V2, Version::V3].into_iter().any(|version| {
        table_like_at(doc.as_table(), &version.runtimes_path())
            .is_some_and(|runtimes| runtimes.contains_key(RUNTIME))
    }))
}

/// gpuplex's runtime entry as the snippet for `version` has it (without the snippet's
/// comments).
pub fn shipped_entry(version: Version) -> Table {
    let mut snippet: DocumentMut = version
        .snippet()
        .parse()
        .expect("the shipped snippets are TOML (tested)");
    let mut table = snippet.as_table_mut();
    for key in version.runtimes_path().into_iter().chain([RUNTIME]) {
        table = table
            .get_mut(key)
            .and_then(Item::as_table_mut)
            .expect("the shipped snippets hold the runtime entry (tested)");
    }
    let mut entry = table.clone();
    entry.decor_mut().set_prefix("");
    entry
}

fn parse(text: &str) -> Result<DocumentMut, ConfigError> {
    text.parse::<DocumentMut>().map_err(|e| located(text, &e))
}

/// A parse error as its line and column (from 1; the column in characters) and one line.
fn located(text: &str, error: &TomlError) -> ConfigError {
    let (line, column) = super::position(text, error.span().map_or(0, |s| s.start));
    ConfigError::Parse {
        line,
        column,
        message: super::one_line(error.message()),
    }
}

fn version_of(doc: &DocumentMut) -> Result<Option<Version>, ConfigError> {
    match doc.get("version") {
        Some(item) => match item.as_integer() {
            Some(2) => Ok(Some(Version::V2)),
            Some(3) => Ok(Some(Version::V3)),
            _ => Err(ConfigError::Version(item.to_string().trim().to_string())),
        },
        None if doc.is_empty() => Ok(None),
        None => Err(ConfigError::NoVersion),
    }
}

/// Adds or updates gpuplex's entry (and `runc`, see the module's doc) in `doc`.
fn add_entries(doc: &mut DocumentMut, version: Version) -> Result<(Entry, bool), ConfigError> {
    let mut next = max_position(doc.as_table()) + 1;
    let runtimes = table_mut(doc.as_table_mut(), &version.runtimes_path())?;
    let mut runc_added = false;
    if version == Version::V2 && runtimes.iter().all(|(key, _)| key == RUNTIME) {
        let mut runc = added_runc();
        runc.set_position(next);
        next += 1;
        runtimes.insert("runc", Item::Table(runc));
        runc_added = true;
    }
    let mut ours = shipped_entry(version);
    let entry = match runtimes.get_mut(RUNTIME) {
        Some(existing) if same_item(existing, &Item::Table(ours.clone())) => Entry::Kept,
        Some(existing) => {
            match existing.as_table() {
                // The operator's table: ours in its place, under its comments.
                Some(table) if !table.is_dotted() && table.position().is_some() => {
                    if let Some(position) = table.position() {
                        ours.set_position(position);
                    }
                    *ours.decor_mut() = table.decor().clone();
                }
                _ => {
                    ours.set_position(next);
                    ours.decor_mut().set_prefix(format!("\n{MARK}.\n"));
                }
            }
            *existing = Item::Table(ours);
            Entry::Updated
        }
        None => {
            ours.set_position(next);
            ours.decor_mut().set_prefix(format!(
                "\n{MARK}: Kubernetes' RuntimeClass `gpuplex`; `gpuplexctl uninstall containerd` removes it.\n"
            ));
            runtimes.insert(RUNTIME, Item::Table(ours));
            Entry::Added
        }
    };
    Ok((entry, runc_added))
}

/// The `runc` table [`add_entries`] names, with its comment.
fn added_runc() -> Table {
    let doc: DocumentMut = RUNC_ENTRY.parse().expect("RUNC_ENTRY is TOML (tested)");
    let mut runc = doc
        .get("runc")
        .and_then(Item::as_table)
        .cloned()
        .expect("RUNC_ENTRY is a table (tested)");
    runc.decor_mut().set_prefix(format!(
        "\n{MARK} with gpuplex's runtime: naming any runtime makes containerd 1.6 and 1.7 drop their built-in runc.\n"
    ));
    runc
}

/// Whether `item` is the `runc` table [`add_entries`] names: its comment and its one key.
fn is_added_runc(item: &Item) -> bool {
    let Some(table) = item.as_table() else {
        return false;
    };
    let marked = table
        .decor()
        .prefix()
        .and_then(|p| p.as_str())
        .is_some_and(|p| p.contains(MARK));
    marked && same_item(item, &Item::Table(added_runc()))
}

/// The greatest position of a table in `table` (parsed tables are numbered in order).
fn max_position(table: &Table) -> usize {
    let mut max = table.position().unwrap_or(0);
    for (_, item) in table.iter() {
        match item {
            Item::Table(t) => max = max.max(max_position(t)),
            Item::ArrayOfTables(array) => {
                for t in array.iter() {
                    max = max.max(max_position(t));
                }
            }
            _ => {}
        }
    }
    max
}

/// The table at `path`, made (implicit, so without a header of its own) where missing.
fn table_mut<'a>(root: &'a mut Table, path: &[&str]) -> Result<&'a mut Table, ConfigError> {
    let mut table = root;
    for (depth, key) in path.iter().enumerate() {
        let item = table.entry(key).or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(true);
            Item::Table(t)
        });
        let what = match item {
            Item::Table(_) => None,
            Item::Value(Value::InlineTable(_)) => Some("an inline table"),
            Item::ArrayOfTables(_) => Some("an array of tables"),
            _ => Some("a value"),
        };
        if let Some(what) = what {
            return Err(ConfigError::NotATable {
                key: dotted(&path[..=depth]),
                what,
            });
        }
        table = item.as_table_mut().expect("checked to be a table");
    }
    Ok(table)
}

fn table_like_at<'a>(root: &'a Table, path: &[&str]) -> Option<&'a dyn TableLike> {
    let mut table: &dyn TableLike = root;
    for key in path {
        table = table.get(key)?.as_table_like()?;
    }
    Some(table)
}

fn table_like_at_mut<'a>(root: &'a mut Table, path: &[&str]) -> Option<&'a mut dyn TableLike> {
    let mut table: &mut dyn TableLike = root;
    for key in path {
        table = table.get_mut(key)?.as_table_like_mut()?;
    }
    Some(table)
}

/// A key path as TOML writes it: `plugins."io.containerd.grpc.v1.cri".containerd`.
fn dotted(path: &[&str]) -> String {
    let mut out = String::new();
    for (i, key) in path.iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        let bare = !key.is_empty()
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if bare {
            out.push_str(key);
        } else {
            let _ = write!(out, "{:?}", key);
        }
    }
    out
}

/// Whether the text reads back with the entry as shipped (and the version it should say).
fn check_read_back(text: &str, version: Version) -> Result<(), ConfigError> {
    let doc = parse(text).map_err(|e| ConfigError::ReadBack(e.to_string()))?;
    if version_of(&doc).map_err(|e| ConfigError::ReadBack(e.to_string()))? != Some(version) {
        return Err(ConfigError::ReadBack(format!(
            "no `version = {}`",
            version.number()
        )));
    }
    let mut path = version.runtimes_path().to_vec();
    path.push(RUNTIME);
    let (last, parents) = path.split_last().expect("a path");
    let entry = table_like_at(doc.as_table(), parents).and_then(|t| t.get(last));
    match entry {
        Some(entry) if same_item(entry, &Item::Table(shipped_entry(version))) => Ok(()),
        _ => Err(ConfigError::ReadBack(format!(
            "[{}] is not the snippet's",
            dotted(&path)
        ))),
    }
}

/// Whether two items hold the same data, however written (a table or an inline one, quotes,
/// spacing, comments).
fn same_item(a: &Item, b: &Item) -> bool {
    match (a.as_table_like(), b.as_table_like()) {
        (Some(x), Some(y)) => same_table(x, y),
        (None, None) => match (a, b) {
            (Item::Value(x), Item::Value(y)) => same_value(x, y),
            (Item::ArrayOfTables(x), Item::ArrayOfTables(y)) => {
                x.len() == y.len() && x.iter().zip(y.iter()).all(|(s, t)| same_table(s, t))
            }
            (Item::None, Item::None) => true,
            _ => false,
        },
        _ => false,
    }
}

fn same_table(x: &dyn TableLike, y: &dyn TableLike) -> bool {
    x.len() == y.len()
        && x.iter()
            .all(|(key, v)| y.get(key).is_some_and(|w| same_item(v, w)))
}

fn same_value(x: &Value, y: &Value) -> bool {
    match (x, y) {
        (Value::String(a), Value::String(b)) => a.value() == b.value(),
        (Value::Integer(a), Value::Integer(b)) => a.value() == b.value(),
        (Value::Float(a), Value::Float(b)) => a.value() == b.value(),
        (Value::Boolean(a), Value::Boolean(b)) => a.value() == b.value(),
        (Value::Datetime(a), Value::Datetime(b)) => a.value() == b.value(),
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b.iter()).all(|(s, t)| same_value(s, t))
        }
        (Value::InlineTable(a), Value::InlineTable(b)) => same_table(a, b),
        _ => false,
    }
}

#[cfg(test)]
mod tests;
