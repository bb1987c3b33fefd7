//! The private containerd's `config.toml`, and gpuplex's shipped runtime entry
//! (`config/containerd/config-v2.toml`) merged into it, so the entry the tests run under is the
//! one users install.

use std::path::{Path, PathBuf};

use toml::{Table, Value};

use super::RUNC;

/// The CRI plugin of containerd 1.6 and 1.7 (config version 2).
pub const CRI_PLUGIN_V2: &str = "io.containerd.grpc.v1.cri";

/// Where config version 2 (containerd 1.6, 1.7) keeps the CRI runtimes, by table.
pub const RUNTIMES_V2: [&str; 4] = ["plugins", CRI_PLUGIN_V2, "containerd", "runtimes"];

/// Where config version 3 (containerd 2.x) keeps them.
pub const RUNTIMES_V3: [&str; 4] = [
    "plugins",
    "io.containerd.cri.v1.runtime",
    "containerd",
    "runtimes",
];

/// The shipped snippet for containerd `version` 2 or 3.
pub fn shipped_snippet(version: u32) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../config/containerd")
        .join(format!("config-v{version}.toml"))
}

/// The snippet for config version 2 or 3, parsed.
pub fn read_shipped_snippet(version: u32) -> Table {
    let path = shipped_snippet(version);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.parse()
        .unwrap_or_else(|e| panic!("{} is not valid TOML: {e}", path.display()))
}

/// The table at `path` (a key per level) in `table`, if every level is a table.
pub fn table_at<'a>(table: &'a Table, path: &[&str]) -> Option<&'a Table> {
    path.iter()
        .try_fold(table, |t, key| t.get(*key).and_then(Value::as_table))
}

/// gpuplex's runtime entry as shipped for containerd 1.6 and 1.7.
pub fn shipped_runtime_entry() -> Table {
    let snippet = read_shipped_snippet(2);
    table_at(&snippet, &RUNTIMES_V2)
        .and_then(|runtimes| runtimes.get("gpuplex"))
        .and_then(Value::as_table)
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{} has no [{}.gpuplex] table",
                shipped_snippet(2).display(),
                RUNTIMES_V2.map(|k| format!("{k:?}")).join(".")
            )
        })
}

/// The table at `path` in `table`, made (with the levels above it) when missing.
pub fn table_at_mut<'a>(table: &'a mut Table, path: &[&str]) -> &'a mut Table {
    path.iter().fold(table, |t, key| {
        t.entry(key.to_string())
            .or_insert_with(|| Value::Table(Table::new()))
            .as_table_mut()
            .unwrap_or_else(|| panic!("{key} in the containerd config is not a table"))
    })
}

/// containerd's configuration with everything under `dir`: root, state, the gRPC, ttrpc and
/// debug sockets, and opt (../shared/notes/container-stack.md §7). The CRI plugin is disabled
/// unless `cri`; gpuplex's shipped runtime entry is in it either way (containerd reads it only
/// for the CRI; `ctr` names its runtime itself).
pub fn containerd_config(dir: &Path, cri: bool) -> Table {
    let path = |name: &str| Value::from(dir.join(name).display().to_string());
    let mut disabled: Vec<Value> = [
        "io.containerd.snapshotter.v1.aufs",
        "io.containerd.snapshotter.v1.btrfs",
        "io.containerd.snapshotter.v1.zfs",
        "io.containerd.snapshotter.v1.devmapper",
    ]
    .map(Value::from)
    .into();
    if !cri {
        disabled.push(Value::from(CRI_PLUGIN_V2));
    }
    let mut config = Table::new();
    config.insert("version".into(), Value::Integer(2));
    config.insert("root".into(), path("root"));
    config.insert("state".into(), path("state"));
    config.insert("disabled_plugins".into(), Value::Array(disabled));
    table_at_mut(&mut config, &["grpc"]).insert("address".into(), path("containerd.sock"));
    table_at_mut(&mut config, &["ttrpc"]).insert("address".into(), path("containerd.sock.ttrpc"));
    let debug = table_at_mut(&mut config, &["debug"]);
    debug.insert("address".into(), path("debug.sock"));
    debug.insert("level".into(), Value::from("debug"));
    table_at_mut(&mut config, &["plugins", "io.containerd.internal.v1.opt"])
        .insert("path".into(), path("opt"));
    if cri {
        cri_settings(dir, table_at_mut(&mut config, &["plugins", CRI_PLUGIN_V2]));
    }
    table_at_mut(&mut config, &RUNTIMES_V2)
        .insert("gpuplex".into(), Value::Table(shipped_runtime_entry()));
    config
}

/// The CRI plugin's settings that containerd 1.6 needs on these machines
/// (../shared/notes/container-stack.md §9). The hook for the Kubernetes-path test: it adds what
/// it needs beyond these (the sandbox image it imports).
fn cri_settings(dir: &Path, cri: &mut Table) {
    // Root lacks CAP_SYS_RESOURCE: the sandbox's oom_score_adj cannot be lowered.
    cri.insert("restrict_oom_score_adj".into(), Value::Boolean(true));
    cri.insert("disable_tcp_service".into(), Value::Boolean(true));
    cri.insert("stream_server_address".into(), Value::from("127.0.0.1"));
    cri.insert("stream_server_port".into(), Value::from("0"));
    cri.insert("disable_apparmor".into(), Value::Boolean(true));
    cri.insert("netns_mounts_under_state_dir".into(), Value::Boolean(true));
    let containerd = table_at_mut(cri, &["containerd"]);
    containerd.insert("snapshotter".into(), Value::from("native"));
    // Naming any runtime replaces containerd's default list, so runc (the default runtime) is
    // named again, with its state in the test's directory rather than the host's.
    let runc = table_at_mut(containerd, &["runtimes", "runc"]);
    runc.insert("runtime_type".into(), Value::from(RUNC));
    table_at_mut(runc, &["options"]).insert(
        "Root".into(),
        Value::from(dir.join("runc").display().to_string()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(entry: &Table, key: &str) -> Vec<String> {
        entry[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key} is not a list"))
            .iter()
            .map(|v| v.as_str().expect("a string").to_string())
            .collect()
    }

    fn check_entry(version: u32, runtimes: &[&str]) {
        let snippet = read_shipped_snippet(version);
        let entry = table_at(&snippet, runtimes)
            .and_then(|r| r.get("gpuplex"))
            .and_then(Value::as_table)
            .unwrap_or_else(|| {
                panic!("config-v{version}.toml: no gpuplex runtime at {runtimes:?}")
            });
        assert_eq!(
            entry["runtime_type"].as_str(),
            Some("io.containerd.gpuplex.v1"),
            "config-v{version}.toml"
        );
        assert_eq!(strings(entry, "pod_annotations"), ["gpuplex.io/*"]);
        assert_eq!(strings(entry, "container_annotations"), ["gpuplex.io/*"]);
        // Nothing else: options for a runtime that is not runc would reach the shim as
        // runtimeoptions.v1.Options, which gpuplex does not read.
        assert_eq!(entry.len(), 3, "config-v{version}.toml: {entry:?}");
    }

    #[test]
    fn the_containerd_snippets_name_the_gpuplex_runtime_where_each_version_reads_it() {
        check_entry(2, &RUNTIMES_V2);
        check_entry(3, &RUNTIMES_V3);
        // Each snippet is only the runtime entry, so it can be appended to any config.toml.
        for version in [2, 3] {
            let snippet = read_shipped_snippet(version);
            assert_eq!(
                snippet.keys().collect::<Vec<_>>(),
                ["plugins"],
                "config-v{version}.toml"
            );
        }
        assert!(table_at(&read_shipped_snippet(3), &RUNTIMES_V2).is_none());
    }

    #[test]
    fn the_runtime_class_names_the_gpuplex_handler() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/kubernetes/runtimeclass.yaml");
        let text = std::fs::read_to_string(&path).expect("config/kubernetes/runtimeclass.yaml");
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect();
        for line in [
            "apiVersion: node.k8s.io/v1",
            "kind: RuntimeClass",
            "  name: gpuplex",
            "handler: gpuplex",
        ] {
            assert!(
                lines.contains(&line),
                "{}: no line {line:?}",
                path.display()
            );
        }
    }

    #[test]
    fn the_generated_config_carries_the_shipped_entry_and_disables_the_cri_unless_asked() {
        let dir = Path::new("/tmp/c");
        let config = containerd_config(dir, false);
        let entry = table_at(&config, &RUNTIMES_V2)
            .and_then(|r| r.get("gpuplex"))
            .and_then(Value::as_table)
            .expect("the gpuplex runtime");
        assert_eq!(entry, &shipped_runtime_entry());
        assert!(config["disabled_plugins"]
            .as_array()
            .expect("a list")
            .contains(&Value::from(CRI_PLUGIN_V2)));
        assert_eq!(
            config["grpc"]["address"].as_str(),
            Some("/tmp/c/containerd.sock")
        );
        // It is valid TOML as written.
        let text = toml::to_string(&config).expect("serializes");
        assert_eq!(text.parse::<Table>().expect("parses"), config);

        let config = containerd_config(dir, true);
        assert!(!config["disabled_plugins"]
            .as_array()
            .expect("a list")
            .contains(&Value::from(CRI_PLUGIN_V2)));
        let runtimes = table_at(&config, &RUNTIMES_V2).expect("runtimes");
        assert_eq!(runtimes["runc"]["runtime_type"].as_str(), Some(RUNC));
        assert_eq!(
            runtimes["gpuplex"].as_table(),
            Some(&shipped_runtime_entry())
        );
    }
}
