//! Tables for the CDI registry, on specs in the style of `nvidia-ctk cdi generate`
//! (`fixtures/nvidia.yaml`), and the edits it chooses applied by the hook's `apply` against the
//! CDI crate's own.

use std::fs;
use std::path::PathBuf;

use serde_json::{json, Value};
use tempfile::TempDir;

use super::*;
use gpuplex_wire::protocol::cdi::CdiDeviceNode;

const NVIDIA_YAML: &str = include_str!("fixtures/nvidia.yaml");
const KIND: &str = "nvidia.com/gpu";
const UUID0: &str = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c";
const UUID1: &str = "GPU-b0a2c1e4-9f3d-11ee-8c90-0242ac120002";

/// A spec of `kind` with one device `name` whose only edit is `env`.
fn small_spec(kind: &str, name: &str, env: &str) -> String {
    format!(
        "cdiVersion: 0.5.0\nkind: {kind}\ndevices:\n- name: \"{name}\"\n  containerEdits:\n    env: [\"{env}\"]\n"
    )
}

/// Spec directories in a temporary directory, each with the files given.
struct Dirs {
    _root: TempDir,
    dirs: Vec<PathBuf>,
}

impl Dirs {
    fn new(contents: &[&[(&str, &str)]]) -> Dirs {
        let root = tempfile::tempdir().unwrap();
        let mut dirs = Vec::new();
        for (i, files) in contents.iter().enumerate() {
            let dir = root.path().join(format!("cdi{i}"));
            fs::create_dir(&dir).unwrap();
            for (name, text) in *files {
                fs::write(dir.join(name), text).unwrap();
            }
            dirs.push(dir);
        }
        Dirs { _root: root, dirs }
    }

    fn load(&self) -> Result<CdiRegistry, CdiError> {
        CdiRegistry::load(&self.dirs, KIND)
    }

    fn file(&self, dir: usize, name: &str) -> PathBuf {
        self.dirs[dir].join(name)
    }
}

fn nvidia() -> (Dirs, CdiRegistry) {
    let dirs = Dirs::new(&[&[("nvidia.yaml", NVIDIA_YAML)]]);
    let registry = dirs.load().unwrap();
    (dirs, registry)
}

/// The `GPUPLEX_TEST_ENTRY` values of some edits: which device entries applied.
fn entries(edits: &CdiEdits) -> Vec<&str> {
    edits
        .env
        .iter()
        .filter_map(|entry| entry.strip_prefix("GPUPLEX_TEST_ENTRY="))
        .collect()
}

fn node(path: &str, major: i64, minor: i64) -> CdiDeviceNode {
    CdiDeviceNode {
        path: path.to_owned(),
        node_type: Some("c".to_owned()),
        major: Some(major),
        minor: Some(minor),
        ..CdiDeviceNode::default()
    }
}

fn cdi_hook(step: &str, link: &[&str]) -> CdiHook {
    let mut args = vec!["nvidia-cdi-hook".to_owned(), step.to_owned()];
    args.extend(link.iter().map(|arg| (*arg).to_owned()));
    CdiHook {
        hook_name: "createContainer".to_owned(),
        path: "/usr/bin/nvidia-cdi-hook".to_owned(),
        args,
        env: vec!["NVIDIA_CTK_DEBUG=false".to_owned()],
        timeout: None,
    }
}

/// The fixture's spec-wide edits, as [`CdiEdits`].
fn spec_wide() -> CdiEdits {
    let libcuda = "/usr/lib/x86_64-linux-gnu/libcuda.so.1";
    CdiEdits {
        env: vec!["NVIDIA_VISIBLE_DEVICES=void".to_owned()],
        device_nodes: vec![node("/dev/nvidiactl", 195, 255)],
        mounts: vec![CdiMount {
            host_path: libcuda.to_owned(),
            container_path: libcuda.to_owned(),
            mount_type: None,
            options: ["ro", "nosuid", "nodev", "bind"]
                .map(str::to_owned)
                .to_vec(),
        }],
        hooks: vec![
            cdi_hook(
                "create-symlinks",
                &[
                    "--link",
                    "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
                ],
            ),
            cdi_hook("update-ldcache", &["--folder", "/usr/lib/x86_64-linux-gnu"]),
        ],
        ..CdiEdits::default()
    }
}

#[test]
fn the_fixture_loads_with_every_device_and_its_file() {
    let (dirs, registry) = nvidia();
    assert!(!registry.is_empty());
    assert_eq!(registry.why_empty(), None);
    assert_eq!(registry.kind(), KIND);
    assert_eq!(registry.spec_files(), vec![dirs.file(0, "nvidia.yaml")]);
    assert_eq!(registry.device_names(), vec!["0", "1", UUID0, UUID1, "all"]);
}

#[test]
fn edits_for_one_gpu_are_the_spec_wide_edits_then_its_uuid_entry() {
    let (dirs, registry) = nvidia();
    let mut expected = spec_wide();
    expected.env.push("GPUPLEX_TEST_ENTRY=uuid-0".to_owned());
    expected.device_nodes.push(node("/dev/nvidia0", 195, 0));
    expected.cdi_devices = vec![format!("{KIND}={UUID0}")];
    expected.spec_files = vec![dirs.file(0, "nvidia.yaml")];
    assert_eq!(registry.edits_for(&[(0, UUID0)]).unwrap(), expected);
}

#[test]
fn edits_for_picks_each_gpus_entry_by_uuid_then_index_and_never_all() {
    let (_dirs, registry) = nvidia();
    let unknown = "GPU-00000000-0000-0000-0000-000000000000";
    // (gpus, the entries applied in order, the device names)
    type Case<'a> = (Vec<(u32, &'a str)>, Vec<&'a str>, Vec<&'a str>);
    let cases: Vec<Case> = vec![
        (vec![(0, UUID0)], vec!["uuid-0"], vec![UUID0]),
        (vec![(1, UUID1)], vec!["uuid-1"], vec![UUID1]),
        // the UUID wins over the index, even when they name different GPUs
        (vec![(1, UUID0)], vec!["uuid-0"], vec![UUID0]),
        (
            vec![(0, UUID0), (1, UUID1)],
            vec!["uuid-0", "uuid-1"],
            vec![UUID0, UUID1],
        ),
        // the order given is kept
        (
            vec![(1, UUID1), (0, UUID0)],
            vec!["uuid-1", "uuid-0"],
            vec![UUID1, UUID0],
        ),
        // no entry for the UUID: the index's
        (vec![(0, unknown)], vec!["index-0"], vec!["0"]),
        (vec![(1, "")], vec!["index-1"], vec!["1"]),
        (
            vec![(0, unknown), (1, UUID1)],
            vec!["index-0", "uuid-1"],
            vec!["0", UUID1],
        ),
        // `all` is never a GPU's entry, even when it is given as its UUID
        (vec![(0, "all")], vec!["index-0"], vec!["0"]),
        // a GPU listed twice counts once
        (vec![(0, UUID0), (0, UUID0)], vec!["uuid-0"], vec![UUID0]),
        (vec![], vec![], vec![]),
    ];
    for (gpus, expected, names) in cases {
        let edits = registry.edits_for(&gpus).unwrap();
        assert_eq!(entries(&edits), expected, "{gpus:?}");
        let names: Vec<String> = names.iter().map(|name| format!("{KIND}={name}")).collect();
        assert_eq!(edits.cdi_devices, names, "{gpus:?}");
        let wide = spec_wide();
        if gpus.is_empty() {
            assert!(edits.is_empty());
            continue;
        }
        // spec-wide first, once
        assert_eq!(edits.env[0], wide.env[0], "{gpus:?}");
        assert_eq!(edits.hooks, wide.hooks, "{gpus:?}");
        assert_eq!(edits.mounts, wide.mounts, "{gpus:?}");
        assert_eq!(edits.device_nodes[0], wide.device_nodes[0], "{gpus:?}");
        // one node per distinct GPU entry: nothing of `all` or of another GPU
        assert_eq!(edits.device_nodes.len(), 1 + names.len(), "{gpus:?}");
    }
}

#[test]
fn edits_for_refuses_a_gpu_with_neither_entry_naming_it_and_the_file() {
    let (dirs, registry) = nvidia();
    let unknown = "GPU-00000000-0000-0000-0000-000000000000";
    for gpus in [
        vec![(7, unknown)],
        vec![(0, UUID0), (7, unknown)],
        vec![(2, "")],
    ] {
        let err = registry.edits_for(&gpus).unwrap_err();
        let text = err.to_string();
        let (index, uuid) = gpus.last().unwrap();
        let file = dirs.file(0, "nvidia.yaml");
        assert!(matches!(err, CdiError::UnknownGpu { .. }), "{text}");
        assert!(
            text.starts_with(&format!("GPU {index} ({uuid}) has no device")),
            "{text}"
        );
        assert!(text.contains(&file.display().to_string()), "{text}");
        assert!(text.contains(&format!("{KIND}={index}")), "{text}");
        assert!(
            text.contains(&format!(
                "nvidia-ctk cdi generate --output={}",
                file.display()
            )),
            "{text}"
        );
        assert!(!text.contains('\n'));
    }
}

#[test]
fn check_inventory_names_the_gpus_only_one_side_has() {
    let (dirs, registry) = nvidia();
    let new = "GPU-11111111-2222-3333-4444-555555555555";
    let file = dirs.file(0, "nvidia.yaml").display().to_string();
    // (the node's UUIDs, the mismatch the message names, or None for Ok)
    let cases: Vec<(Vec<&str>, Option<String>)> = vec![
        (vec![UUID0, UUID1], None),
        (vec![UUID1, UUID0], None),
        (vec![UUID0], Some(format!("(in the spec only: {UUID1})"))),
        (
            vec![UUID0, UUID1, new],
            Some(format!("(on the node only: {new})")),
        ),
        (
            vec![new, UUID1, new],
            Some(format!(
                "(in the spec only: {UUID0}; on the node only: {new})"
            )),
        ),
        (
            vec![],
            Some(format!("(in the spec only: {UUID0}, {UUID1})")),
        ),
    ];
    for (uuids, part) in cases {
        match (registry.check_inventory(&uuids), part) {
            (Ok(()), None) => {}
            (Err(err), Some(part)) => {
                let text = err.to_string();
                assert!(matches!(err, CdiError::Inventory { .. }));
                assert!(
                    text.starts_with(&format!(
                        "the {KIND} CDI spec {file} does not match this node's GPUs {part}"
                    )),
                    "{text}"
                );
                assert!(text.ends_with(&format!("--output={file}")), "{text}");
            }
            (result, part) => panic!("{uuids:?}: {result:?}, expected {part:?}"),
        }
    }
}

#[test]
fn check_inventory_passes_a_spec_without_uuid_names_and_an_empty_registry() {
    let index_only = small_spec(KIND, "0", "A=1");
    let dirs = Dirs::new(&[&[("nvidia.yaml", &index_only)]]);
    let registry = dirs.load().unwrap();
    assert_eq!(registry.check_inventory(&[UUID0]).unwrap(), ());
    // ... while edits_for still goes by the index
    assert_eq!(registry.edits_for(&[(0, UUID0)]).unwrap().env, vec!["A=1"]);

    let empty = Dirs::new(&[&[]]).load().unwrap();
    assert!(empty.check_inventory(&[UUID0]).is_ok());
}

#[test]
fn an_empty_registry_says_where_it_looked_and_how_to_make_a_spec() {
    let dirs = Dirs::new(&[&[("intel.yaml", &small_spec("intel.com/gpu", "0", "A=1"))]]);
    let absent = dirs.dirs[0].parent().unwrap().join("absent");
    let list = [dirs.dirs[0].clone(), absent.clone()];
    let registry = CdiRegistry::load(&list, KIND).unwrap();
    assert!(registry.is_empty());
    let why = registry.why_empty().unwrap();
    let expected = format!(
        "no CDI spec of kind {KIND} (searched {}, {} (absent), found only intel.com/gpu); \
         generate one: nvidia-ctk cdi generate --output={}",
        list[0].display(),
        absent.display(),
        list[0].join("nvidia.yaml").display()
    );
    assert_eq!(why, expected);
    let err = registry.edits_for(&[(0, UUID0)]).unwrap_err();
    assert!(matches!(err, CdiError::NoSpec { .. }));
    assert_eq!(err.to_string(), expected);

    let none = CdiRegistry::load(std::slice::from_ref(&absent), KIND).unwrap();
    assert_eq!(
        none.why_empty().unwrap(),
        format!(
            "no CDI spec of kind {KIND} (searched {} (absent)); generate one: \
             nvidia-ctk cdi generate --output={}",
            absent.display(),
            absent.join("nvidia.yaml").display()
        )
    );
    let no_dirs = CdiRegistry::load(&[], KIND).unwrap();
    assert!(no_dirs
        .why_empty()
        .unwrap()
        .contains("(no CDI spec directory is configured)"));
}

#[test]
fn a_malformed_spec_is_one_line_naming_the_file_and_the_fault() {
    let spec = |extra: &str| format!("cdiVersion: 0.5.0\nkind: {KIND}\n{extra}");
    // (file contents, what the message says after the file name)
    let cases: Vec<(String, &str)> = vec![
        ("cdiVersion: [not a spec\n".to_owned(), "not YAML or JSON: "),
        ("{\"cdiVersion\": \"0.5.0\",".to_owned(), "not YAML or JSON: "),
        ("".to_owned(), "not a CDI spec: it has no \"kind\" string"),
        ("- a\n- list\n".to_owned(), "not a CDI spec: it has no \"kind\" string"),
        (
            spec("foo: 1\ndevices:\n- name: \"0\"\n  containerEdits:\n    env: [A=1]\n"),
            "does not parse: unknown field `foo`",
        ),
        (
            spec("devices:\n- name: \"bad name!\"\n  containerEdits:\n    env: [A=1]\n"),
            "not a valid CDI spec: device \"bad name!\": the name \"bad name!\" does not end with a letter or digit",
        ),
        (
            spec("devices:\n- name: \"0\"\n  containerEdits:\n    deviceNodes: [{path: /dev/x, type: x}]\n"),
            "not a valid CDI spec: device \"0\": device \"/dev/x\": invalid type \"x\"",
        ),
        (
            spec("devices:\n- name: \"0\"\n  containerEdits:\n    hooks: [{hookName: nope, path: /bin/true}]\n"),
            "not a valid CDI spec: device \"0\": invalid hook name: \"nope\"",
        ),
        (
            spec("devices:\n- name: \"0\"\n  containerEdits:\n    env: [NOEQUALS]\n"),
            "not a valid CDI spec: device \"0\": invalid environment variable \"NOEQUALS\"",
        ),
        (
            spec("devices: []\n"),
            "not a valid CDI spec: invalid spec, no devices",
        ),
        (
            small_spec(KIND, "0", "A=1").replace("0.5.0", "9.9.9"),
            "not a valid CDI spec: cdiVersion \"9.9.9\" is not a CDI version",
        ),
        (
            small_spec(KIND, "0", "A=1").replace("0.5.0", "0.3.0"),
            "must be at least v0.5.0",
        ),
    ];
    for (text, fault) in cases {
        let dirs = Dirs::new(&[&[("nvidia.yaml", NVIDIA_YAML), ("z.yaml", &text)]]);
        let err = dirs.load().unwrap_err();
        let message = err.to_string();
        let prefix = format!("CDI spec {}: ", dirs.file(0, "z.yaml").display());
        assert!(matches!(err, CdiError::Spec { .. }), "{message}");
        assert!(message.starts_with(&prefix), "{message}");
        assert!(message.contains(fault), "{message} lacks {fault}");
        assert!(!message.contains('\n'), "{message}");
    }
}

#[test]
fn a_bad_kind_is_refused_when_it_is_the_kind_asked_for() {
    // A spec's kind is compared before it is validated: a spec of any other kind, valid or
    // not, is someone else's and only counted; the configured kind itself, if malformed,
    // reaches validation.
    let bad = small_spec("nvidia.com", "0", "A=1");
    let dirs = Dirs::new(&[&[("bad.yaml", &bad)]]);
    assert!(dirs.load().unwrap().is_empty());
    let err = CdiRegistry::load(&dirs.dirs, "nvidia.com").unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "CDI spec {}: not a valid CDI spec: ",
            dirs.file(0, "bad.yaml").display()
        )),
        "{message}"
    );
    assert!(
        message.ends_with("kind \"nvidia.com\": not vendor/class"),
        "{message}"
    );
    assert!(!message.contains('\n'), "{message}");

    // another kind's spec that is not valid does not stop gpuplex
    let broken_other = "cdiVersion: 0.5.0\nkind: intel.com/gpu\nfoo: 1\ndevices: []\n";
    let dirs = Dirs::new(&[&[("nvidia.yaml", NVIDIA_YAML), ("intel.yaml", broken_other)]]);
    assert_eq!(dirs.load().unwrap().device_names().len(), 5);
}

#[test]
fn a_later_directory_overrides_an_earlier_one_device_by_device() {
    let override0 = format!(
        "cdiVersion: 0.5.0\nkind: {KIND}\ncontainerEdits:\n  env: [FROM=runtime]\n\
         devices:\n- name: \"0\"\n  containerEdits:\n    env: [GPUPLEX_TEST_ENTRY=override-index-0]\n\
         - name: {UUID0}\n  containerEdits:\n    env: [GPUPLEX_TEST_ENTRY=override-uuid-0]\n"
    );
    let dirs = Dirs::new(&[
        &[("nvidia.yaml", NVIDIA_YAML)],
        &[("nvidia.yaml", &override0)],
    ]);
    let registry = dirs.load().unwrap();
    let (low, high) = (dirs.file(0, "nvidia.yaml"), dirs.file(1, "nvidia.yaml"));
    assert_eq!(registry.spec_files(), vec![low.as_path(), high.as_path()]);

    // GPU 0 only: the later spec's entry and spec-wide edits, none of the earlier spec's
    let edits = registry.edits_for(&[(0, UUID0)]).unwrap();
    assert_eq!(
        edits.env,
        ["FROM=runtime", "GPUPLEX_TEST_ENTRY=override-uuid-0"]
    );
    assert_eq!(edits.spec_files, vec![high.clone()]);
    assert!(edits.device_nodes.is_empty() && edits.hooks.is_empty());

    // GPU 0 then 1: each spec's spec-wide edits once, in order of first use, then the devices
    let edits = registry.edits_for(&[(0, UUID0), (1, UUID1)]).unwrap();
    assert_eq!(edits.spec_files, vec![high.clone(), low.clone()]);
    assert_eq!(entries(&edits), ["override-uuid-0", "uuid-1"]);
    assert_eq!(
        edits.env[..2],
        ["FROM=runtime", "NVIDIA_VISIBLE_DEVICES=void"]
    );
    assert_eq!(edits.hooks, spec_wide().hooks);

    // the index entry is overridden too
    let unknown = "GPU-00000000-0000-0000-0000-000000000000";
    assert_eq!(
        entries(&registry.edits_for(&[(0, unknown)]).unwrap()),
        ["override-index-0"]
    );
    // the order of the directories decides, not their names
    let reversed = [dirs.dirs[1].clone(), dirs.dirs[0].clone()];
    let registry = CdiRegistry::load(&reversed, KIND).unwrap();
    assert_eq!(
        entries(&registry.edits_for(&[(0, UUID0)]).unwrap()),
        ["uuid-0"]
    );
}

#[test]
fn two_files_of_one_directory_defining_a_device_is_an_error_naming_both() {
    let other = small_spec(KIND, "1", "A=1");
    let dirs = Dirs::new(&[&[("a-nvidia.yaml", NVIDIA_YAML), ("b-extra.json", &other)]]);
    let err = dirs.load().unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "CDI specs {} and {} both define {KIND}=1 and, being in the same directory, \
             neither takes precedence: remove one",
            dirs.file(0, "a-nvidia.yaml").display(),
            dirs.file(0, "b-extra.json").display()
        )
    );
    // distinct device names in one directory are fine
    let dirs = Dirs::new(&[&[
        ("nvidia.yaml", NVIDIA_YAML),
        ("extra.json", &small_spec(KIND, "9", "A=1")),
    ]]);
    assert_eq!(dirs.load().unwrap().device_names().len(), 6);
}

#[test]
fn only_spec_files_directly_in_a_directory_are_read() {
    let dirs = Dirs::new(&[&[
        ("nvidia.yaml", NVIDIA_YAML),
        ("README.txt", "not a spec"),
        ("nvidia.yaml.bak", "not a spec either"),
    ]]);
    let nested = dirs.dirs[0].join("nested.yaml");
    fs::create_dir(&nested).unwrap();
    fs::write(nested.join("broken.yaml"), "cdiVersion: [").unwrap();
    let registry = dirs.load().unwrap();
    assert_eq!(registry.spec_files(), vec![dirs.file(0, "nvidia.yaml")]);

    // JSON specs are read too
    let as_json = serde_json::to_string(&json!({
        "cdiVersion": "0.5.0", "kind": KIND,
        "devices": [{"name": "0", "containerEdits": {"env": ["A=1"]}}],
    }))
    .unwrap();
    let dirs = Dirs::new(&[&[("nvidia.json", &as_json)]]);
    assert_eq!(dirs.load().unwrap().device_names(), vec!["0"]);
}

#[test]
fn a_spec_directory_that_is_a_file_is_an_error() {
    let dirs = Dirs::new(&[&[("nvidia.yaml", NVIDIA_YAML)]]);
    let file = dirs.file(0, "nvidia.yaml");
    let err = CdiRegistry::load(std::slice::from_ref(&file), KIND).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "cannot read CDI spec directory {}: ",
            file.display()
        )),
        "{text}"
    );
}

#[test]
fn edits_gpuplex_does_not_apply_are_refused_when_chosen() {
    let net = format!(
        "cdiVersion: 1.1.0\nkind: {KIND}\ndevices:\n\
         - name: \"0\"\n  containerEdits:\n    netDevices: [{{hostInterfaceName: eth0, name: eth1}}]\n\
         - name: \"1\"\n  containerEdits:\n    env: [A=1]\n"
    );
    let dirs = Dirs::new(&[&[("nvidia.yaml", &net)]]);
    let registry = dirs.load().unwrap();
    assert_eq!(registry.edits_for(&[(1, "")]).unwrap().env, ["A=1"]);
    let err = registry.edits_for(&[(0, "")]).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "CDI spec {}: {KIND}=0 asks for netDevices, which gpuplex does not apply",
            dirs.file(0, "nvidia.yaml").display()
        )
    );
}

#[test]
fn apply_matches_the_crates_own_apply_on_an_oci_spec() {
    // The crate's ContainerEdits::apply on oci-spec's default Spec, against ours on the same
    // spec as JSON: the same devices, rules, env, mounts and hooks.
    use container_device_interface::spec::read_spec;
    let (dirs, registry) = nvidia();
    let mut crate_spec = read_spec(&dirs.file(0, "nvidia.yaml"), 0).unwrap();
    let mut theirs = oci_spec::runtime::Spec::default();
    crate_spec.apply_edits(&mut theirs).unwrap();
    let mut device = crate_spec.get_device(UUID0).unwrap().clone();
    device.apply_edits(&mut theirs).unwrap();
    let theirs = serde_json::to_value(&theirs).unwrap();

    let mut ours = serde_json::to_value(oci_spec::runtime::Spec::default()).unwrap();
    let edits = registry.edits_for(&[(0, UUID0)]).unwrap();
    gpuplex_hook::cdi::apply(&mut ours, &edits).unwrap();
    // oci-spec keeps capabilities in hash sets: their order differs from one Spec to the next
    let without_capabilities = |mut spec: Value| {
        spec["process"]
            .as_object_mut()
            .unwrap()
            .remove("capabilities");
        spec
    };
    assert_eq!(without_capabilities(ours), without_capabilities(theirs));
}

#[test]
fn the_edits_for_gpu_0_are_the_ones_the_hooks_tests_apply() {
    // The hook's tests of `apply` run on these edits, kept as the reply carries them.
    let (_dirs, registry) = nvidia();
    let mut edits = registry.edits_for(&[(0, UUID0)]).unwrap();
    edits.spec_files = vec![PathBuf::from("/etc/cdi/nvidia.yaml")];
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../hook/src/cdi/fixtures/nvidia-gpu0-edits.json"
    );
    let sent: CdiEdits = serde_json::from_slice(&fs::read(fixture).unwrap()).unwrap();
    assert_eq!(edits, sent);
}
