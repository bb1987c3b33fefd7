//! gpuplex's runtime entry edited into containerd configs and out again.

use super::*;
use std::path::{Path, PathBuf};

use crate::install::{run, Request, Target};

/// Debian 12's `/etc/containerd/config.toml` (containerd 1.6.20): version 2, no runtime named.
const DEBIAN: &str = r#"version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"#;

/// An operator's config: comments, odd quoting and spacing, runc and a runtime of their own.
const OPERATOR: &str = r#"# Managed by hand. Do not reorder.
version = 2
root = "/var/lib/containerd"   # the default

[grpc]
  address = '/run/containerd/containerd.sock'

[plugins.'io.containerd.grpc.v1.cri']
  sandbox_image = "registry.k8s.io/pause:3.9"
  # our runtimes
  [plugins.'io.containerd.grpc.v1.cri'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.runc.options]
        SystemdCgroup = true
    [plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.kata]
      runtime_type = "io.containerd.kata.v2"

[metrics]
  address = "127.0.0.1:1338"   # scraped
# trailing words
"#;

/// containerd 2.x's layout (version 3).
const V3: &str = r#"version = 3

[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
"#;

fn entry_in(text: &str, version: Version) -> Table {
    let doc: DocumentMut = text.parse().unwrap();
    let mut path = version.runtimes_path().to_vec();
    path.push(RUNTIME);
    let mut table = doc.as_table();
    for key in path {
        table = table
            .get(key)
            .and_then(Item::as_table)
            .unwrap_or_else(|| panic!("no table {key} in {text}"));
    }
    table.clone()
}

fn has_runc(text: &str) -> bool {
    let doc: DocumentMut = text.parse().unwrap();
    table_like_at(doc.as_table(), &Version::V2.runtimes_path())
        .is_some_and(|r| r.contains_key("runc"))
}

#[test]
fn the_snippets_are_one_runtime_entry_each() {
    for version in [Version::V2, Version::V3] {
        let entry = shipped_entry(version);
        let keys: Vec<&str> = entry.iter().map(|(k, _)| k).collect();
        assert_eq!(
            keys,
            ["runtime_type", "pod_annotations", "container_annotations"]
        );
        assert_eq!(
            entry["runtime_type"].as_str(),
            Some("io.containerd.gpuplex.v1")
        );
        // Nothing else in the snippet: what install adds is all of it.
        fn values(table: &Table) -> usize {
            table
                .iter()
                .map(|(_, item)| match item {
                    Item::Table(t) => values(t),
                    _ => 1,
                })
                .sum()
        }
        let snippet: DocumentMut = version.snippet().parse().unwrap();
        assert_eq!(values(snippet.as_table()), 3);
    }
    let runc: DocumentMut = RUNC_ENTRY.parse().unwrap();
    assert!(runc.get("runc").and_then(Item::as_table).is_some());
}

#[test]
fn an_entry_goes_at_the_end_and_everything_else_stays() {
    let edit = edit(OPERATOR, Version::V2).unwrap();
    assert_eq!(edit.entry, Entry::Added);
    assert!(!edit.runc_added, "the operator names runc");
    // The operator's text, byte for byte, then the entry (before the trailing comment, which
    // toml_edit keeps last).
    let (body, tail) = OPERATOR.split_at(OPERATOR.find("# trailing words").unwrap());
    let expected = format!(
        "{body}\n{MARK}: Kubernetes' RuntimeClass `gpuplex`; `gpuplexctl uninstall containerd` removes it.\n[plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.gpuplex]\n  runtime_type = \"io.containerd.gpuplex.v1\"\n  pod_annotations = [\"gpuplex.io/*\"]\n  container_annotations = [\"gpuplex.io/*\"]\n{tail}"
    );
    assert_eq!(edit.text, expected);
    assert_eq!(
        entry_in(&edit.text, Version::V2).to_string(),
        shipped_entry(Version::V2).to_string()
    );
    // The operator's runtimes are as they were.
    let doc: DocumentMut = edit.text.parse().unwrap();
    let runtimes = table_like_at(doc.as_table(), &Version::V2.runtimes_path()).unwrap();
    let names: Vec<&str> = runtimes.iter().map(|(k, _)| k).collect();
    assert_eq!(names, ["runc", "kata", "gpuplex"]);
}

#[test]
fn a_second_edit_changes_nothing() {
    for (text, version) in [
        (DEBIAN, Version::V2),
        (OPERATOR, Version::V2),
        (V3, Version::V3),
        ("", Version::V2),
        ("# nothing yet\n", Version::V3),
    ] {
        let first = edit(text, version).unwrap();
        assert!(first.changed());
        let second = edit(&first.text, version).unwrap();
        assert!(!second.changed(), "{}", first.text);
        assert_eq!(second.text, first.text);
        assert_eq!(second.entry, Entry::Kept);
    }
}

#[test]
fn a_config_naming_no_runtime_gets_runc_too_in_version_2_only() {
    let edit2 = edit(DEBIAN, Version::V2).unwrap();
    assert!(edit2.runc_added);
    assert!(edit2.text.starts_with(DEBIAN), "{}", edit2.text);
    assert!(has_runc(&edit2.text));
    let added = &edit2.text[DEBIAN.len()..];
    assert_eq!(
        added,
        format!(
            "\n{MARK} with gpuplex's runtime: naming any runtime makes containerd 1.6 and 1.7 drop their built-in runc.\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\
             \n{MARK}: Kubernetes' RuntimeClass `gpuplex`; `gpuplexctl uninstall containerd` removes it.\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpuplex]\n  runtime_type = \"io.containerd.gpuplex.v1\"\n  pod_annotations = [\"gpuplex.io/*\"]\n  container_annotations = [\"gpuplex.io/*\"]\n"
        )
    );
    let edit3 = edit(V3, Version::V3).unwrap();
    assert!(!edit3.runc_added);
    assert!(edit3.text.starts_with(V3));
    assert!(
        edit3
            .text
            .contains("[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpuplex]\n"),
        "{}",
        edit3.text
    );
    assert!(!edit3.text.contains("runc"));
    // The snippet appended by hand to a config naming no runtime (the broken state): runc added.
    let by_hand = format!("{DEBIAN}\n{SNIPPET_V2}");
    let fixed = edit(&by_hand, Version::V2).unwrap();
    assert_eq!(fixed.entry, Entry::Kept);
    assert!(fixed.runc_added && fixed.changed());
    assert!(fixed.text.starts_with(&by_hand));
}

#[test]
fn a_changed_entry_is_replaced_in_its_place() {
    let text = format!(
        "{}\n# our gpuplex, tuned\n[plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.gpuplex]\n  runtime_type = \"io.containerd.gpuplex.v0\"\n  privileged_without_host_devices = true\n  [plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.gpuplex.options]\n    BinaryName = \"x\"\n\n[metrics]\n  address = \"127.0.0.1:1338\"\n",
        OPERATOR.split("\n[metrics]").next().unwrap()
    );
    let edit = edit(&text, Version::V2).unwrap();
    assert_eq!(edit.entry, Entry::Updated);
    let expected = text.replace(
        "  runtime_type = \"io.containerd.gpuplex.v0\"\n  privileged_without_host_devices = true\n  [plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.gpuplex.options]\n    BinaryName = \"x\"\n",
        "  runtime_type = \"io.containerd.gpuplex.v1\"\n  pod_annotations = [\"gpuplex.io/*\"]\n  container_annotations = [\"gpuplex.io/*\"]\n",
    );
    assert_eq!(edit.text, expected);
    // Written another way but the same: kept, not a byte changed.
    let inline = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes]\n  runc = { runtime_type = \"io.containerd.runc.v2\" }\n  gpuplex = { runtime_type = 'io.containerd.gpuplex.v1', pod_annotations = ['gpuplex.io/*'], container_annotations = [ \"gpuplex.io/*\" ] } # mine\n";
    let kept = super::edit(inline, Version::V2).unwrap();
    assert!(!kept.changed());
    assert_eq!(kept.text, inline);
    // An inline entry that differs becomes a table of its own.
    let differs = inline.replace("'io.containerd.gpuplex.v1'", "'other'");
    let updated = super::edit(&differs, Version::V2).unwrap();
    assert_eq!(updated.entry, Entry::Updated);
    assert!(!updated.text.contains("'other'"));
    assert_eq!(entry_in(&updated.text, Version::V2).len(), 3);
}

#[test]
fn a_config_with_no_settings_gets_its_version() {
    let edit = edit("", Version::V3).unwrap();
    assert!(edit.version_added);
    assert!(
        edit.text.starts_with("version = 3\n\n# Added by"),
        "{}",
        edit.text
    );
    assert_eq!(file_version(&edit.text).unwrap(), Some(Version::V3));
    let comments = "# containerd config\n# (empty on purpose)";
    let edit = super::edit(comments, Version::V2).unwrap();
    assert!(
        edit.text
            .starts_with("# containerd config\n# (empty on purpose)\n\nversion = 2\n"),
        "{}",
        edit.text
    );
    assert!(edit.runc_added);
    assert_eq!(file_version("").unwrap(), None);
    assert_eq!(file_version("  \n# c\n").unwrap(), None);
}

#[test]
fn versions_gpuplex_does_not_edit_are_refused() {
    assert_eq!(
        file_version("version = 1\n").unwrap_err(),
        ConfigError::Version("1".into())
    );
    assert_eq!(
        file_version("version = \"2\"\n").unwrap_err(),
        ConfigError::Version("\"2\"".into())
    );
    assert_eq!(
        file_version("[plugins.cri]\n  x = 1\n").unwrap_err(),
        ConfigError::NoVersion
    );
    assert_eq!(
        edit(DEBIAN, Version::V3).unwrap_err(),
        ConfigError::Mismatch {
            found: 2,
            wanted: 3
        }
    );
    assert_eq!(file_version(V3).unwrap(), Some(Version::V3));
    let err = edit(
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  runtimes = { runc = { runtime_type = \"io.containerd.runc.v2\" } }\n",
        Version::V2,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "`plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes` is an inline table, not a [table]: gpuplex's runtime goes in [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpuplex]; write it as a [table] and run this again"
    );
    assert!(matches!(
        edit("version = 2\nplugins = 3\n", Version::V2).unwrap_err(),
        ConfigError::NotATable {
            what: "a value",
            ..
        }
    ));
}

#[test]
fn a_parse_error_names_its_line_and_column() {
    let err = edit("version = 2\n\n[plugins\nx = 1\n", Version::V2).unwrap_err();
    let ConfigError::Parse {
        line,
        column,
        message,
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!((*line, *column), (3, 9), "{err}");
    assert!(
        !message.contains('\n') && !message.is_empty(),
        "{message:?}"
    );
    // The snippet appended twice, as `cat >>` twice did.
    let twice = format!("{DEBIAN}\n{SNIPPET_V2}\n{SNIPPET_V2}");
    let err = edit(&twice, Version::V2).unwrap_err();
    let header = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpuplex]";
    let second = twice.rfind(header).unwrap();
    let line_of_second = twice[..second].matches('\n').count() + 1;
    match &err {
        ConfigError::Parse { line, .. } => assert_eq!(*line, line_of_second, "{err}"),
        other => panic!("{other:?}"),
    }
    assert!(!err.to_string().contains('\n'));
    // Columns count characters, not bytes.
    let err = file_version("# é\nversion = é\n").unwrap_err();
    assert!(err.to_string().starts_with("line 2, column 11: "), "{err}");
    assert_eq!(
        remove("[a\n").unwrap_err(),
        file_version("[a\n").unwrap_err()
    );
}

#[test]
fn remove_takes_out_what_edit_added_and_nothing_else() {
    for (text, version) in [
        (DEBIAN, Version::V2),
        (OPERATOR, Version::V2),
        (V3, Version::V3),
    ] {
        let installed = edit(text, version).unwrap().text;
        assert!(has_entry(&installed).unwrap());
        let removed = remove(&installed).unwrap();
        assert_eq!(removed, text, "{installed}");
        assert!(!has_entry(&removed).unwrap());
        // Nothing to remove: the same bytes.
        assert_eq!(remove(text).unwrap(), text);
    }
    // The runc we named stays once the operator names another runtime.
    let installed = edit(DEBIAN, Version::V2).unwrap().text;
    let more = format!("{installed}\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crun]\n  runtime_type = \"io.containerd.runc.v2\"\n");
    let removed = remove(&more).unwrap();
    assert!(has_runc(&removed) && !has_entry(&removed).unwrap());
    // An operator's own runc (no mark) is never removed.
    let theirs = format!("{DEBIAN}\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\n{SNIPPET_V2}");
    assert!(has_runc(&remove(&theirs).unwrap()));
}

#[test]
fn containerd_releases_give_config_versions() {
    for (output, expected) in [
        ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n", Ok(Version::V2)),
        ("containerd containerd.io 1.7.25 bcc810d6b9066471b0b6fa75f557a15a1cbf31bb\n", Ok(Version::V2)),
        ("containerd github.com/containerd/containerd/v2 v2.0.4 1a43cb6a1035441f9aca8f5666a9b3ef9e70ab20\n", Ok(Version::V3)),
        ("containerd github.com/containerd/containerd/v2 v3.0.0 x\n", Err("containerd 3.0.0, whose config version gpuplex does not know".to_string())),
        ("nonsense\n", Err("no release number in `nonsense`".to_string())),
    ] {
        assert_eq!(Version::of_containerd(output), expected, "{output}");
    }
}

/// A `containerd` that says it is `release`.
fn fake_containerd(dir: &Path, release: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("containerd");
    std::fs::write(
        &path,
        format!("#!/bin/sh\necho containerd github.com/containerd/containerd {release} abc\n"),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn request(config: &Path, containerd: &Path, uninstall: bool, dry_run: bool) -> Request {
    Request {
        uninstall,
        dry_run,
        target: Target::Containerd {
            config: Some(config.to_path_buf()),
            containerd: containerd.to_path_buf(),
        },
    }
}

fn run_line(request: &Request) -> Result<String, String> {
    let mut out = Vec::new();
    match run(request, &mut out) {
        Ok(()) => Ok(String::from_utf8(out).unwrap()),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn install_keeps_a_backup_and_uninstall_restores_it_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    let backup = dir.path().join("config.toml.gpuplex-orig");
    let no_containerd = dir.path().join("absent");
    std::fs::write(&config, OPERATOR).unwrap();
    let line = run_line(&request(&config, &no_containerd, false, false)).unwrap();
    assert_eq!(
        line,
        format!("added gpuplex's runtime gpuplex to {c} (config version 2, the file's); the original is kept in {c}.gpuplex-orig; restart containerd: systemctl restart containerd\n", c = config.display())
    );
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), OPERATOR);
    let installed = std::fs::read_to_string(&config).unwrap();
    let line = run_line(&request(&config, &no_containerd, false, false)).unwrap();
    assert_eq!(line.lines().count(), 1);
    assert!(line.contains("already has gpuplex's runtime"), "{line}");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), installed);
    let line = run_line(&request(&config, &no_containerd, true, false)).unwrap();
    assert!(line.starts_with("restored "), "{line}");
    assert_eq!(std::fs::read(&config).unwrap(), OPERATOR.as_bytes());
    assert!(!backup.exists());
    let line = run_line(&request(&config, &no_containerd, true, false)).unwrap();
    assert!(
        line.contains("has no gpuplex runtime; nothing changed"),
        "{line}"
    );
}

#[test]
fn uninstall_after_other_changes_takes_out_the_entry_only() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    let backup = dir.path().join("config.toml.gpuplex-orig");
    let no_containerd = dir.path().join("absent");
    std::fs::write(&config, DEBIAN).unwrap();
    run_line(&request(&config, &no_containerd, false, false)).unwrap();
    let changed = std::fs::read_to_string(&config)
        .unwrap()
        .replace("/etc/cni/net.d", "/etc/cni/mine");
    std::fs::write(&config, &changed).unwrap();
    let line = run_line(&request(&config, &no_containerd, true, false)).unwrap();
    assert!(line.contains("it changed since install"), "{line}");
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        DEBIAN.replace("/etc/cni/net.d", "/etc/cni/mine")
    );
    assert_eq!(std::fs::read_to_string(&backup).unwrap(), DEBIAN);
}

#[test]
fn a_missing_config_is_made_for_the_installed_containerd_and_removed_again() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("etc/containerd/config.toml");
    let containerd = fake_containerd(dir.path(), "v2.1.0");
    let line = run_line(&request(&config, &containerd, false, false)).unwrap();
    assert!(
        line.starts_with(&format!(
            "created {} with gpuplex's runtime gpuplex (config version 3, from {})",
            config.display(),
            containerd.display()
        )),
        "{line}"
    );
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.starts_with("version = 3\n"), "{text}");
    assert!(!dir
        .path()
        .join("etc/containerd/config.toml.gpuplex-orig")
        .exists());
    let line = run_line(&request(&config, &containerd, true, false)).unwrap();
    assert!(line.starts_with("removed "), "{line}");
    assert!(!config.exists());
    // Without a version and without containerd: refused, in one line.
    let err = run_line(&request(&config, &dir.path().join("absent"), false, false)).unwrap_err();
    assert!(
        err.contains("does not say its config version") && !err.contains('\n'),
        "{err}"
    );
    assert!(!config.exists());
}

#[test]
fn dry_run_shows_the_diff_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    let no_containerd = dir.path().join("absent");
    std::fs::write(&config, DEBIAN).unwrap();
    let out = run_line(&request(&config, &no_containerd, false, true)).unwrap();
    let c = config.display();
    assert!(
        out.starts_with(&format!(
            "--- {c}\n+++ {c}\n@@ -7,3 +7,13 @@\n       conf_dir = \"/etc/cni/net.d\"\n"
        )),
        "{out}"
    );
    assert!(
        out.contains("\n+[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpuplex]\n"),
        "{out}"
    );
    assert!(out.ends_with(&format!("dry run, nothing changed: it would add gpuplex's runtime gpuplex to {c} (config version 2, the file's, with runc named too: naming any runtime makes containerd 1.6 and 1.7 drop their built-in runc); keeping the original in {c}.gpuplex-orig\n")), "{out}");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), DEBIAN);
    assert!(!dir.path().join("config.toml.gpuplex-orig").exists());
    // A bad config: one line naming the file, its line and column, and nothing changed.
    std::fs::write(&config, "version = 2\n[plugins\n").unwrap();
    let err = run_line(&request(&config, &no_containerd, false, false)).unwrap_err();
    assert!(
        err.starts_with(&format!("{c}: line 2, column 9: ")),
        "{err}"
    );
    assert!(
        err.ends_with("; nothing changed") && !err.contains('\n'),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        "version = 2\n[plugins\n"
    );
}
