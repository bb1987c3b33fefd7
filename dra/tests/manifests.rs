//! Every Kubernetes manifest gpuplex ships parses into its k8s-openapi type, and nothing of it
//! is lost on the way: a field the type does not know (a typo, a field of another version)
//! would be dropped by the API server or refused by `kubectl apply --validate=strict`.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn manifests() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/kubernetes");
    let mut found = Vec::new();
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The fields of `written` that `read` lacks, as paths.
fn lost(written: &Value, read: &Value, at: &str, out: &mut Vec<String>) {
    match (written, read) {
        (Value::Object(w), Value::Object(r)) => {
            for (key, value) in w {
                match r.get(key) {
                    Some(back) => lost(value, back, &format!("{at}.{key}"), out),
                    None => out.push(format!("{at}.{key}")),
                }
            }
        }
        (Value::Array(w), Value::Array(r)) => {
            for (i, (value, back)) in w.iter().zip(r).enumerate() {
                lost(value, back, &format!("{at}[{i}]"), out);
            }
            if w.len() != r.len() {
                out.push(format!("{at} (length)"));
            }
        }
        _ => {}
    }
}

fn check<T: DeserializeOwned + Serialize>(path: &Path, written: Value) {
    let typed: T = serde_json::from_value(written.clone())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let read = serde_json::to_value(&typed).unwrap();
    let mut missing = Vec::new();
    lost(&written, &read, "", &mut missing);
    assert!(
        missing.is_empty(),
        "{}: unknown fields {missing:?}",
        path.display()
    );
}

#[test]
fn every_shipped_manifest_parses_into_its_type_with_no_unknown_field() {
    let found = manifests();
    assert!(found.len() >= 4, "{found:?}");
    for path in found {
        let text = std::fs::read_to_string(&path).unwrap();
        for document in serde_yaml::Deserializer::from_str(&text) {
            let written = Value::deserialize(document).unwrap();
            let kind = written["kind"].as_str().unwrap_or_default().to_owned();
            match kind.as_str() {
                "RuntimeClass" => check::<RuntimeClass>(&path, written),
                "DeviceClass" => check::<DeviceClass>(&path, written),
                "ResourceClaimTemplate" => check::<ResourceClaimTemplate>(&path, written),
                "Pod" => check::<Pod>(&path, written),
                "Namespace" => check::<Namespace>(&path, written),
                "ServiceAccount" => check::<ServiceAccount>(&path, written),
                "ConfigMap" => check::<ConfigMap>(&path, written),
                "ClusterRole" => check::<ClusterRole>(&path, written),
                "ClusterRoleBinding" => check::<ClusterRoleBinding>(&path, written),
                "DaemonSet" => check::<DaemonSet>(&path, written),
                "NetworkPolicy" => check::<NetworkPolicy>(&path, written),
                other => panic!("{}: no test knows kind {other:?}", path.display()),
            }
        }
    }
}

#[test]
fn the_daemonsets_gpuplex_toml_is_valid_and_switches_to_the_device_plugin_in_one_line() {
    use gpuplex_wire::config::{KubeletPlugin, NodeConfig};
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/kubernetes/gpuplex.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let map = serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .find(|d| d["kind"] == "ConfigMap")
        .expect("the ConfigMap");
    let toml = map["data"]["gpuplex.toml"].as_str().unwrap();
    let config = NodeConfig::parse(toml).unwrap();
    assert_eq!(config.kubernetes.plugin, KubeletPlugin::Dra);
    let switched = toml.replace("plugin = \"dra\"", "plugin = \"device-plugin\"");
    let config = NodeConfig::parse(&switched).unwrap();
    assert_eq!(config.kubernetes.plugin, KubeletPlugin::DevicePlugin);
    // The plugin's container sees the kubelet's device plugin directory.
    assert!(text.contains("mountPath: /var/lib/kubelet/device-plugins"));
}

#[test]
fn the_metrics_policy_admits_the_daemonsets_pods_on_the_metrics_port_only() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/kubernetes");
    let read = |name: &str| -> Value {
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        let found = serde_yaml::Deserializer::from_str(&text)
            .map(|d| Value::deserialize(d).unwrap())
            .find(|d| d["kind"] == "NetworkPolicy" || d["kind"] == "DaemonSet");
        found.unwrap()
    };
    let policy = read("metrics-networkpolicy.yaml");
    let daemonset = read("gpuplex.yaml");
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"],
        daemonset["spec"]["template"]["metadata"]["labels"]
    );
    assert_eq!(
        policy["metadata"]["namespace"],
        daemonset["metadata"]["namespace"]
    );
    assert_eq!(
        policy["spec"]["policyTypes"],
        serde_json::json!(["Ingress"])
    );
    let rules = policy["spec"]["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 1);
    assert_eq!(
        rules[0]["ports"],
        serde_json::json!([{"protocol": "TCP", "port": 9400}])
    );
    // The port is the one gpuplex.toml's documentation gives as metrics_listen's example.
    let toml = std::fs::read_to_string(dir.join("../gpuplex.toml")).unwrap();
    assert!(
        toml.contains("\"127.0.0.1:9400\""),
        "config/gpuplex.toml: metrics_listen's example"
    );
}
