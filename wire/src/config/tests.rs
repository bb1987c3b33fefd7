use super::*;

const INSTALLED: &str = include_str!("../../../config/gpuplex.toml");

#[test]
fn the_installed_file_documents_every_default() {
    assert_eq!(NodeConfig::parse(INSTALLED), Ok(NodeConfig::default()));
    // Every [service] key is written out, not left to the defaults; the example fake GPU is
    // commented out and complete.
    for key in [
        "socket",
        "state_dir",
        "activity",
        "sample_interval",
        "freeze_timeout",
        "metrics_listen",
        "node_name",
        "cdi_spec_dirs",
        "cdi_kind",
    ] {
        assert!(
            INSTALLED
                .lines()
                .any(|l| l.starts_with(&format!("{key} ="))),
            "{key} is not documented"
        );
    }
    let example: String = INSTALLED
        .lines()
        .skip_while(|l| !l.starts_with("# [[fake_gpu]]"))
        .map(|l| l.trim_start_matches("# ").trim_start_matches('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let parsed = NodeConfig::parse(&example).unwrap();
    assert_eq!(parsed.fake_gpus[0].memory, 40 << 30);
}

#[test]
fn fake_gpus_and_service_keys_are_read() {
    let config = NodeConfig::parse(
        r#"
[scheduler]
slice = "100ms"
[service]
socket = "/tmp/x/gpuplex.sock"
activity = "cpu"
sample_interval = "20ms"
metrics_listen = "127.0.0.1:9400"
[[fake_gpu]]
uuid = "GPU-fake-0"
model = "Fake A100"
memory = "16Gi"
device = "/dev/fake0"
[[fake_gpu]]
uuid = "GPU-fake-1"
model = "Fake A100"
memory = "1.5Gi"
device = "/dev/fake1"
"#,
    )
    .unwrap();
    assert_eq!(config.scheduler.slice, Duration::from_millis(100));
    assert_eq!(config.service.activity, ActivityChoice::Cpu);
    assert_eq!(config.service.sample_interval, Duration::from_millis(20));
    assert_eq!(config.service.socket, PathBuf::from("/tmp/x/gpuplex.sock"));
    assert_eq!(config.service.state_dir, ServiceConfig::default().state_dir);
    assert_eq!(config.fake_gpus.len(), 2);
    assert_eq!(config.fake_gpus[1].memory, 1610612736);
}

#[test]
fn bad_input_is_one_line_naming_the_key() {
    let cases: &[(&str, &str)] = &[
        ("[servce]\n", "unknown field `servce`"),
        ("[service]\nsockett = \"/x\"\n", "line 2 (service.sockett)"),
        ("[service]\nsample_interval = \"fast\"\n", "line 2 (service.sample_interval)"),
        ("[service]\nsample_interval = \"0ms\"\n", "service.sample_interval = \"0s\" is not accepted"),
        ("[service]\nactivity = \"gpu\"\n", "line 2 (service.activity)"),
        ("[service]\nsocket = \"run/x.sock\"\n", "service.socket = \"run/x.sock\" is not accepted: an absolute path"),
        ("[service]\nmetrics_listen = \"9400\"\n", "service.metrics_listen = \"9400\" is not accepted"),
        ("[scheduler]\nslice = \"0ms\"\n", "scheduler.slice"),
        (
            "[[fake_gpu]]\nuuid = \"GPU-0\"\nmodel = \"m\"\nmemory = \"lots\"\ndevice = \"/dev/f\"\n",
            "fake_gpu[0].memory = \"lots\" is not accepted",
        ),
        (
            "[[fake_gpu]]\nuuid = \"GPU-0\"\nmodel = \"m\"\nmemory = \"1Gi\"\n",
            "missing field `device`",
        ),
        (
            "[[fake_gpu]]\nuuid = \"GPU-0\"\nmodel = \"m\"\nmemory = \"1Gi\"\ndevice = \"/dev/a\"\n\
             [[fake_gpu]]\nuuid = \"GPU-0\"\nmodel = \"m\"\nmemory = \"1Gi\"\ndevice = \"/dev/b\"\n",
            "fake_gpu[1].uuid = \"GPU-0\" is not accepted: another fake GPU has it",
        ),
        (
            "[[fake_gpu]]\nuuid = \"GPU-0\"\nmodel = \"m\"\nmemory = \"1Gi\"\ndevice = \"dev/a\"\n",
            "an absolute path",
        ),
        (
            "[service]\ncdi_kind = \"gpu\"\n",
            "service.cdi_kind = \"gpu\" is not accepted: a CDI kind like \"nvidia.com/gpu\"",
        ),
        (
            "[service]\ncdi_spec_dirs = [\"/etc/cdi\", \"\"]\n",
            "service.cdi_spec_dirs = [\"\"] is not accepted: a list of directories",
        ),
        ("[service]\ncdi_spec_dirs = \"/etc/cdi\"\n", "line 2 (service.cdi_spec_dirs)"),
        ("[service]\nsocket = 3\n", "line 2 (service.socket)"),
        ("[service\n", "line 1"),
    ];
    for (text, expected) in cases {
        let err = NodeConfig::parse(text).unwrap_err().to_string();
        assert!(err.contains(expected), "{text:?}: {err}");
        assert!(!err.contains('\n'), "{text:?}: {err}");
    }
}

#[test]
fn an_absent_default_file_means_defaults_but_a_named_one_must_exist() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("none.toml");
    assert_eq!(
        NodeConfig::load(&absent, false).unwrap(),
        NodeConfig::default()
    );
    let err = NodeConfig::load(&absent, true).unwrap_err().to_string();
    assert!(err.starts_with("cannot read the configuration"), "{err}");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[service]\nx = 1\n").unwrap();
    let err = NodeConfig::load(&bad, true).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!("{}: line 2 (service.x)", bad.display())),
        "{err}"
    );
}

#[test]
fn the_flag_beats_the_environment_which_beats_the_default() {
    use std::ffi::OsStr;
    let flag = Path::new("/a.toml");
    assert_eq!(
        config_path(Some(flag), Some(OsStr::new("/b.toml"))),
        (flag.into(), true)
    );
    assert_eq!(
        config_path(None, Some(OsStr::new("/b.toml"))),
        ("/b.toml".into(), true)
    );
    assert_eq!(
        config_path(None, Some(OsStr::new(""))),
        (DEFAULT_CONFIG.into(), false)
    );
    assert_eq!(config_path(None, None), (DEFAULT_CONFIG.into(), false));
}

#[test]
fn the_cdi_settings_are_the_service_keys() {
    let config = NodeConfig::parse(
        "[service]\ncdi_spec_dirs = [\"/a\", \"/b\"]\ncdi_kind = \"example.com/gpu\"\n",
    )
    .unwrap();
    assert_eq!(
        config.service.cdi(),
        CdiSettings {
            spec_dirs: vec![PathBuf::from("/a"), PathBuf::from("/b")],
            kind: "example.com/gpu".into(),
        }
    );
    let default = CdiSettings::default();
    assert_eq!(
        default.spec_dirs,
        [Path::new("/etc/cdi"), Path::new("/var/run/cdi")]
    );
    assert_eq!(default.kind, "nvidia.com/gpu");
}

#[test]
fn an_error_keeps_its_cause() {
    use std::error::Error;
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[service]\nsocket = \"x\"\n").unwrap();
    let err = NodeConfig::load(&bad, true).unwrap_err();
    let cause = err.source().unwrap().to_string();
    assert_eq!(
        cause,
        "service.socket = \"x\" is not accepted: an absolute path"
    );
    assert_eq!(err.to_string(), format!("{}: {cause}", bad.display()));
}

#[test]
fn the_kubernetes_section_is_read_and_checked() {
    let config = NodeConfig::parse(
        "[kubernetes]\nplugin = \"device-plugin\"\ngpu_memory_unit = \"512Mi\"\ndevice_plugin_devices = \"cdi\"\n",
    )
    .unwrap();
    assert_eq!(
        config.kubernetes,
        KubernetesConfig {
            plugin: KubeletPlugin::DevicePlugin,
            gpu_memory_unit: 512 << 20,
            device_plugin_devices: DeviceDelivery::Cdi,
        }
    );
    for (text, key) in [
        ("gpu_memory_unit = \"1Mi\"", "kubernetes.gpu_memory_unit = \"1Mi\" is not accepted: a Kubernetes quantity from 64Mi to 1Ti"),
        ("gpu_memory_unit = \"lots\"", "kubernetes.gpu_memory_unit = \"lots\""),
        ("plugin = \"both\"", "kubernetes.plugin"),
        ("device_plugin_devices = \"nvidia\"", "kubernetes.device_plugin_devices"),
        ("units = 3", "kubernetes.units"),
    ] {
        let err = NodeConfig::parse(&format!("[kubernetes]\n{text}\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key) && !err.contains('\n'), "{text}: {err}");
    }
}
