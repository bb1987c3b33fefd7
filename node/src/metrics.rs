//! The Prometheus endpoint: [`render`] writes a [`NodeStatus`] in the OpenMetrics text format
//! (prometheus-client's encoder, which Prometheus scrapes as it does its own text format), and
//! [`serve`] answers `GET /metrics` with it.
//!
//! Labels follow dcgm-exporter, so dashboards can join the two: every series has `gpu` (the
//! index), `UUID`, `modelName` and `Hostname`; container series add `container`, `pod` and
//! `namespace` (empty when unknown). A container bound to several GPUs has one series per GPU:
//! its GPU time is split evenly between them (the status sums it over its GPUs), while its wait
//! and frozen time, windows, wait quantiles and weight are its own and repeat on each.
//! `gpuplex_container_holding` is 1 on the series of the GPU whose window the container's vGPU
//! holds (every container of a shared claim's vGPU holds it together), so a dashboard can draw
//! who held each GPU over time. The wait quantiles are two gauges rather than one with a
//! `quantile` label, a label that Prometheus' linter keeps for summaries.
//!
//! `config/grafana/gpuplex-dashboard.json` is a Grafana dashboard of these metrics; a test here
//! holds every metric its queries name to one this endpoint exports.
//!
//! Label values come from tenants (a pod's name, a container id); prometheus-client escapes
//! them (backslash, double quote, newline), so a value can never end its label or its line
//! (a test holds it to that).
//!
//! The server is small: a thread per connection, at most [`Limits::connections`] at once and
//! [`Limits::per_peer`] from one address (more are closed at once), each given
//! [`Limits::deadline`] in all to send its request and take the answer, `Connection: close`.
//! Connections that send half a request and wait cannot hold a scrape up: they take at most their
//! address's share of the slots, for at most the deadline. It is meant for a scraper on the node
//! or the cluster network, off unless `metrics_listen` is set; on a pod network, the
//! NetworkPolicy in `config/kubernetes/metrics-networkpolicy.yaml` admits the scraper's
//! namespace only.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use gpuplex_scheduler::node::{ContainerState, ContainerStatus, GpuStatus, NodeStatus};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long one connection may take to send its request and receive the answer.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);

/// How many connections the endpoint answers at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// For one connection, to send its request and take the answer ([`CONNECTION_TIMEOUT`]).
    pub deadline: Duration,
    /// Open at once, in all (64).
    pub connections: usize,
    /// Open at once from one IP address (8): a scraper elsewhere is answered whatever one
    /// address holds open.
    pub per_peer: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            deadline: CONNECTION_TIMEOUT,
            connections: 64,
            per_peer: 8,
        }
    }
}

/// The connections open now, in all and per address.
#[derive(Default)]
struct Open {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// One connection's place among the open ones, given back when it is dropped.
struct Slot {
    open: Arc<Mutex<Open>>,
    peer: IpAddr,
}

impl Slot {
    /// A place for a connection from `peer`, unless `limits` are reached.
    fn take(open: &Arc<Mutex<Open>>, peer: IpAddr, limits: &Limits) -> Option<Slot> {
        let mut now = open.lock().unwrap_or_else(|e| e.into_inner());
        let from_peer = now.per_peer.get(&peer).copied().unwrap_or(0);
        if now.total >= limits.connections || from_peer >= limits.per_peer {
            return None;
        }
        now.total += 1;
        now.per_peer.insert(peer, from_peer + 1);
        Some(Slot {
            open: Arc::clone(open),
            peer,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut now = self.open.lock().unwrap_or_else(|e| e.into_inner());
        now.total -= 1;
        if let Some(count) = now.per_peer.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                now.per_peer.remove(&self.peer);
            }
        }
    }
}

/// The longest request head read, in bytes.
const MAX_REQUEST: usize = 8 * 1024;

/// A sample's value: a count or a quantity.
#[derive(Clone, Copy, Debug)]
enum Value {
    Count(u64),
    Quantity(f64),
}

/// What a metric is: a counter (its name gets `_total`) or a gauge.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    fn encode(self, value: Value, encoder: MetricEncoder<'_>) -> std::fmt::Result {
        match (self, value) {
            (Kind::Counter, Value::Count(v)) => ConstCounter::new(v).encode(encoder),
            (Kind::Counter, Value::Quantity(v)) => ConstCounter::new(v).encode(encoder),
            (Kind::Gauge, Value::Count(v)) => ConstGauge::new(v).encode(encoder),
            (Kind::Gauge, Value::Quantity(v)) => ConstGauge::new(v).encode(encoder),
        }
    }

    fn metric_type(self) -> MetricType {
        match self {
            Kind::Counter => MetricType::Counter,
            Kind::Gauge => MetricType::Gauge,
        }
    }
}

/// A GPU metric: name (a counter's without `_total`), kind, help, and its value for one GPU.
type GpuMetric = (&'static str, Kind, &'static str, fn(&GpuStatus) -> Value);

/// A container metric: the same, with its value for one container on one of its GPUs.
type ContainerMetric = (
    &'static str,
    Kind,
    &'static str,
    fn(&ContainerStatus, OnGpu) -> Value,
);

/// Which of a container's GPUs a series is about.
#[derive(Clone, Copy, Debug)]
struct OnGpu {
    /// The GPU's position in the container's `gpus`.
    pos: usize,
    /// The container's vGPU holds the GPU's window.
    holding: bool,
}

use Kind::{Counter, Gauge};
use Value::{Count, Quantity};

#[rustfmt::skip]
const GPU_METRICS: [GpuMetric; 6] = [
    ("gpuplex_gpu_busy_seconds", Counter,
        "Seconds some container ran on the GPU with work.", |g| Quantity(g.busy_seconds)),
    ("gpuplex_gpu_window_switches", Counter,
        "Windows passed on the GPU from one container to another.", |g| Count(g.switches)),
    ("gpuplex_gpu_memory_bytes", Gauge,
        "The GPU's memory in bytes.", |g| Count(g.memory)),
    ("gpuplex_gpu_unreserved_memory_bytes", Gauge,
        "GPU memory no container's entitlement holds, in bytes.", |g| Count(g.unreserved)),
    ("gpuplex_gpu_containers", Gauge,
        "Containers bound to the GPU.", |g| Count(g.containers.len() as u64)),
    ("gpuplex_gpu_fake", Gauge,
        "1 when the GPU is declared in [[fake_gpu]] rather than found by NVML.",
        |g| Count(u64::from(g.fake))),
];

#[rustfmt::skip]
const CONTAINER_METRICS: [ContainerMetric; 11] = [
    ("gpuplex_container_gpu_seconds", Counter,
        "Seconds the container ran on the GPU with its window.",
        |c, _| Quantity(c.gpu_seconds / c.gpus.len().max(1) as f64)),
    ("gpuplex_container_wait_seconds", Counter,
        "Seconds the container waited for a window, the current wait included.",
        |c, _| Quantity(c.wait_seconds)),
    ("gpuplex_container_frozen_seconds", Counter,
        "Seconds the container's cgroup was frozen.", |c, _| Quantity(c.frozen_seconds)),
    ("gpuplex_container_windows", Counter,
        "Windows the container received.", |c, _| Count(c.windows)),
    ("gpuplex_container_lag_seconds", Gauge,
        "Seconds of GPU time the container is owed (positive) or has had ahead of its weighted \
         share (negative) on the GPU; while idle, what it keeps for its next work.",
        |c, _| Quantity(c.lag_seconds / c.gpus.len().max(1) as f64)),
    ("gpuplex_container_frozen", Gauge,
        "1 while the container is frozen, waiting for a window.",
        |c, _| Count(u64::from(c.state == ContainerState::Frozen))),
    ("gpuplex_container_holding", Gauge,
        "1 while the container (its vGPU) holds the GPU's window.",
        |_, on| Count(u64::from(on.holding))),
    ("gpuplex_container_wait_p50_seconds", Gauge,
        "The median of the container's completed waits for a window, in seconds \
         (within about 3%, since the node service started; 0 before one ended).",
        |c, _| Quantity(c.wait_p50_seconds)),
    ("gpuplex_container_wait_p99_seconds", Gauge,
        "The 99th percentile of the container's completed waits for a window, in seconds \
         (within about 3%, since the node service started; 0 before one ended).",
        |c, _| Quantity(c.wait_p99_seconds)),
    ("gpuplex_container_memory_bytes", Gauge,
        "The container's memory entitlement on the GPU, in bytes.",
        |c, on| Count(c.memory.get(on.pos).copied().unwrap_or(0))),
    ("gpuplex_container_weight", Gauge,
        "The container's share weight.", |c, _| Count(u64::from(c.weight))),
];

/// A label set: names and values.
type Labels = Vec<(&'static str, String)>;

/// One scrape's status, as prometheus-client collects it.
#[derive(Debug)]
struct Scrape(NodeStatus);

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let status = &self.0;
        let host = &status.node;
        let gpus: Vec<(&GpuStatus, Labels)> = status
            .gpus
            .iter()
            .map(|g| (g, gpu_labels(g.index, &g.uuid, &g.model, host)))
            .collect();
        for (name, kind, help, value) in GPU_METRICS {
            let mut family = encoder.encode_descriptor(name, help, None, kind.metric_type())?;
            for (g, labels) in &gpus {
                kind.encode(value(g), family.encode_family(labels)?)?;
            }
        }
        // One series per container and GPU it is bound to.
        let bound: Vec<(&ContainerStatus, OnGpu, Labels)> = status
            .containers
            .iter()
            .flat_map(|c| c.gpus.iter().enumerate().map(move |(pos, &i)| (c, pos, i)))
            .map(|(c, pos, index)| {
                let gpu = status.gpus.iter().find(|g| g.index == index);
                let (uuid, model) = gpu.map_or(("", ""), |g| (g.uuid.as_str(), g.model.as_str()));
                let holder = gpu.and_then(|g| g.holder.as_deref());
                let holding = holder.is_some_and(|h| same_vgpu(status, h, c));
                let mut labels = gpu_labels(index, uuid, model, host);
                labels.extend([
                    ("container", c.id.clone()),
                    ("pod", c.pod.clone().unwrap_or_default()),
                    ("namespace", c.namespace.clone().unwrap_or_default()),
                ]);
                (c, OnGpu { pos, holding }, labels)
            })
            .collect();
        for (name, kind, help, value) in CONTAINER_METRICS {
            let mut family = encoder.encode_descriptor(name, help, None, kind.metric_type())?;
            for (c, on, labels) in &bound {
                kind.encode(value(c, *on), family.encode_family(labels)?)?;
            }
        }
        Ok(())
    }
}

/// Whether the container `holder` is `c` or shares its vGPU (a claim's containers take their
/// windows together, and a GPU's status names only the first of them).
fn same_vgpu(status: &NodeStatus, holder: &str, c: &ContainerStatus) -> bool {
    holder == c.id
        || status
            .containers
            .iter()
            .any(|o| o.id == holder && o.vgpu == c.vgpu)
}

/// The status in the OpenMetrics text format, every metric with its `# HELP` and `# TYPE`,
/// ending with `# EOF`.
pub fn render(status: &NodeStatus) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(status.clone())));
    let mut out = String::new();
    // Writing to a String does not fail, and every value above is encodable.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

fn gpu_labels(index: u32, uuid: &str, model: &str, host: &str) -> Labels {
    vec![
        ("gpu", index.to_string()),
        ("UUID", uuid.to_owned()),
        ("modelName", model.to_owned()),
        ("Hostname", host.to_owned()),
    ]
}

/// Answers HTTP requests on `listener` on threads of their own, for as long as the process
/// lives, within `limits`: `GET` (or `HEAD`) `/metrics` with [`render`] of what `status`
/// returns (503 when it returns `None`), anything else with 404, a request line it cannot read
/// with 400. A connection beyond the limits is closed unanswered; a failed one is logged and
/// skipped.
pub fn serve(
    listener: TcpListener,
    limits: Limits,
    status: impl Fn() -> Option<NodeStatus> + Send + Sync + 'static,
) -> io::Result<thread::JoinHandle<()>> {
    let status = Arc::new(status);
    let open = Arc::new(Mutex::new(Open::default()));
    thread::Builder::new()
        .name("gpuplex-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let stream = match stream {
                    Ok(stream) => stream,
                    Err(e) => {
                        tracing::warn!("metrics: cannot accept a connection: {e}");
                        // Out of file descriptors and the like: do not spin.
                        thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                };
                let Ok(peer) = stream.peer_addr() else {
                    continue;
                };
                let Some(slot) = Slot::take(&open, peer.ip(), &limits) else {
                    tracing::debug!("metrics: {peer}: too many connections open, closed");
                    continue;
                };
                let status = Arc::clone(&status);
                let spawned = thread::Builder::new()
                    .name("gpuplex-metrics-conn".into())
                    .spawn(move || {
                        let _slot = slot;
                        if let Err(e) = answer(stream, limits.deadline, &*status) {
                            tracing::debug!("metrics: {peer}: {e}");
                        }
                    });
                if let Err(e) = spawned {
                    tracing::warn!("metrics: cannot start a thread for {peer}: {e}");
                }
            }
        })
}

fn answer(
    mut stream: TcpStream,
    deadline: Duration,
    status: &dyn Fn() -> Option<NodeStatus>,
) -> io::Result<()> {
    let deadline = Instant::now() + deadline;
    let head = read_head(&mut stream, deadline)?;
    let request_line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let request_line = String::from_utf8_lossy(request_line);
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next(), parts.next());
    let path = target.map(|t| t.split('?').next().unwrap_or(t));
    let (code, content_type, body) = match (method, path) {
        (Some("GET" | "HEAD"), Some("/metrics")) => match status() {
            Some(s) => ("200 OK", CONTENT_TYPE, render(&s)),
            None => (
                "503 Service Unavailable",
                "text/plain; charset=utf-8",
                "the node status is not available yet\n".to_string(),
            ),
        },
        (Some(_), Some(_)) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: the metrics are at /metrics\n".to_string(),
        ),
        _ => (
            "400 Bad Request",
            "text/plain; charset=utf-8",
            "bad request\n".to_string(),
        ),
    };
    let mut response = format!(
        "HTTP/1.1 {code}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    response.push_str("\r\n");
    if method != Some("HEAD") {
        response.push_str(&body);
    }
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_write_timeout(Some(left))?;
    stream.write_all(response.as_bytes())?;
    stream.flush()
}

/// Reads up to the blank line that ends the request head, within [`MAX_REQUEST`] bytes and
/// by `deadline`. A head cut short is returned as it is.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while head.len() < MAX_REQUEST && !ends_head(&head) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(head)
}

fn ends_head(head: &[u8]) -> bool {
    head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplex_scheduler::request::Priority;
    use std::collections::BTreeSet;

    fn status() -> NodeStatus {
        let gpu = |index: u32, containers: &[&str]| GpuStatus {
            index,
            uuid: format!("GPU-{index}"),
            model: "Fake \"A100\"".into(),
            memory: 1000,
            fake: index == 1,
            capacity: 0,
            healthy: true,
            unreserved: 400,
            holder: (index == 0).then(|| "two".to_string()),
            busy_seconds: 2.5,
            switches: 3,
            containers: containers.iter().map(|c| c.to_string()).collect(),
            reservations: vec![],
        };
        NodeStatus {
            node: "node\\1".into(),
            activity: "cpu".into(),
            cdi: String::new(),
            gpus: vec![gpu(0, &["two"]), gpu(1, &["two"])],
            containers: vec![ContainerStatus {
                id: "two".into(),
                vgpu: "vgpu-1".into(),
                gpus: vec![0, 1],
                memory: vec![600, 500],
                weight: 2,
                priority: Priority::Normal,
                state: ContainerState::Frozen,
                gpu_seconds: 5.0,
                wait_seconds: 1.5,
                waiting_seconds: 0.5,
                frozen_seconds: 1.25,
                windows: 4,
                lag_seconds: -0.5,
                wait_p50_seconds: 0.25,
                wait_p99_seconds: 0.75,
                pod: Some("web\nx".into()),
                namespace: None,
                claim: None,
            }],
            reservations: vec![],
        }
    }

    const G0: &str = r#"gpu="0",UUID="GPU-0",modelName="Fake \"A100\"",Hostname="node\\1""#;
    const G1: &str = r#"gpu="1",UUID="GPU-1",modelName="Fake \"A100\"",Hostname="node\\1""#;
    const C: &str = r#"container="two",pod="web\nx",namespace="""#;

    #[test]
    fn every_metric_once_with_help_and_type() {
        let text = render(&status());
        let names: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        assert_eq!(names.len(), 17);
        for line in names {
            let name = line.split(' ').next().unwrap();
            let help = format!("# HELP {name} ");
            assert_eq!(text.matches(&help).count(), 1, "{name}");
            assert_eq!(text.matches(&format!("# TYPE {name} ")).count(), 1);
        }
        assert!(text.contains("# TYPE gpuplex_gpu_busy_seconds counter\n"));
        assert!(text.contains("# TYPE gpuplex_container_frozen gauge\n"));
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn exact_samples_escaping_and_multi_gpu_split() {
        let text = render(&status());
        for line in [
            format!("gpuplex_gpu_busy_seconds_total{{{G0}}} 2.5"),
            format!("gpuplex_gpu_window_switches_total{{{G1}}} 3"),
            format!("gpuplex_gpu_memory_bytes{{{G0}}} 1000"),
            format!("gpuplex_gpu_unreserved_memory_bytes{{{G0}}} 400"),
            format!("gpuplex_gpu_containers{{{G1}}} 1"),
            format!("gpuplex_gpu_fake{{{G0}}} 0"),
            format!("gpuplex_gpu_fake{{{G1}}} 1"),
            format!("gpuplex_container_gpu_seconds_total{{{G0},{C}}} 2.5"),
            format!("gpuplex_container_gpu_seconds_total{{{G1},{C}}} 2.5"),
            format!("gpuplex_container_wait_seconds_total{{{G1},{C}}} 1.5"),
            format!("gpuplex_container_frozen_seconds_total{{{G0},{C}}} 1.25"),
            format!("gpuplex_container_windows_total{{{G1},{C}}} 4"),
            format!("gpuplex_container_lag_seconds{{{G0},{C}}} -0.25"),
            format!("gpuplex_container_frozen{{{G0},{C}}} 1"),
            format!("gpuplex_container_holding{{{G0},{C}}} 1"),
            format!("gpuplex_container_holding{{{G1},{C}}} 0"),
            format!("gpuplex_container_wait_p50_seconds{{{G0},{C}}} 0.25"),
            format!("gpuplex_container_wait_p99_seconds{{{G1},{C}}} 0.75"),
            format!("gpuplex_container_memory_bytes{{{G0},{C}}} 600"),
            format!("gpuplex_container_memory_bytes{{{G1},{C}}} 500"),
            format!("gpuplex_container_weight{{{G1},{C}}} 2"),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line}\nin\n{text}"
            );
        }
        assert_eq!(
            text.lines().filter(|l| !l.starts_with('#')).count(),
            6 * 2 + 11 * 2
        );
    }

    #[test]
    fn every_container_of_the_holding_vgpu_holds_the_window() {
        let mut status = status();
        let mut mate = status.containers[0].clone();
        mate.id = "mate".into();
        let mut other = mate.clone();
        other.id = "other".into();
        other.vgpu = "vgpu-2".into();
        status.containers.extend([mate, other]);
        let text = render(&status);
        for (container, g, holds) in [
            ("two", G0, 1),
            ("mate", G0, 1),
            ("other", G0, 0),
            ("two", G1, 0),
            ("mate", G1, 0),
            ("other", G1, 0),
        ] {
            let c = C.replace(r#""two""#, &format!(r#""{container}""#));
            let line = format!("gpuplex_container_holding{{{g},{c}}} {holds}");
            assert!(
                text.lines().any(|l| l == line),
                "missing {line}\nin\n{text}"
            );
        }
    }

    /// The dashboard, its metric names checked against what [`render`] exports.
    const DASHBOARD: &str = include_str!("../../config/grafana/gpuplex-dashboard.json");

    /// Checks a Grafana dashboard: it parses, has the template variables its queries use, every
    /// panel has a title and targets with queries on the `datasource` variable, and every
    /// `gpuplex_` metric any query names is one `exported` holds. Returns the names used.
    fn check_dashboard(json: &str, exported: &BTreeSet<&str>) -> Result<BTreeSet<String>, String> {
        let dashboard: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
        let variables: Vec<(&str, &str)> = dashboard["templating"]["list"]
            .as_array()
            .ok_or("no templating list")?
            .iter()
            .map(|v| {
                (
                    v["name"].as_str().unwrap_or(""),
                    v["type"].as_str().unwrap_or(""),
                )
            })
            .collect();
        for wanted in [
            ("datasource", "datasource"),
            ("Hostname", "query"),
            ("gpu", "query"),
        ] {
            if !variables.contains(&wanted) {
                return Err(format!("no template variable {wanted:?}"));
            }
        }
        let mut panels: Vec<&serde_json::Value> = Vec::new();
        for panel in dashboard["panels"].as_array().ok_or("no panels")? {
            panels.push(panel);
            // A collapsed row keeps its panels inside it.
            panels.extend(panel["panels"].as_array().into_iter().flatten());
        }
        for panel in panels {
            let title = panel["title"].as_str().unwrap_or("");
            if title.is_empty() {
                return Err(format!("a panel without a title: {panel}"));
            }
            if panel["type"] == "row" {
                continue;
            }
            let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
            if targets.is_empty() {
                return Err(format!("panel {title:?} has no target"));
            }
            for target in targets {
                if target["expr"].as_str().is_none_or(str::is_empty) {
                    return Err(format!("panel {title:?} has a target without a query"));
                }
                if target["datasource"]["uid"] != "${datasource}" {
                    return Err(format!("panel {title:?} does not query $datasource"));
                }
            }
        }
        let mut queries = Vec::new();
        collect_queries(&dashboard, &mut queries);
        let used: BTreeSet<String> = queries
            .iter()
            .flat_map(|q| metric_names(q))
            .map(str::to_owned)
            .collect();
        let unknown: Vec<&String> = used
            .iter()
            .filter(|n| !exported.contains(n.as_str()))
            .collect();
        if !unknown.is_empty() {
            return Err(format!("metrics the endpoint does not export: {unknown:?}"));
        }
        Ok(used)
    }

    /// Every query in a dashboard: targets' `expr`, template variables' `query` and
    /// `definition`, wherever they are.
    fn collect_queries<'a>(value: &'a serde_json::Value, out: &mut Vec<&'a str>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, v) in map {
                    match (key.as_str(), v.as_str()) {
                        ("expr" | "query" | "definition", Some(q)) => out.push(q),
                        _ => collect_queries(v, out),
                    }
                }
            }
            serde_json::Value::Array(items) => {
                items.iter().for_each(|v| collect_queries(v, out));
            }
            _ => {}
        }
    }

    /// The metric names starting with `gpuplex_` in a PromQL query.
    fn metric_names(query: &str) -> Vec<&str> {
        let name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
        let mut names = Vec::new();
        let mut from = 0;
        while let Some(at) = query[from..].find("gpuplex_").map(|at| from + at) {
            let end = query[at..]
                .find(|c: char| !name_char(c))
                .map_or(query.len(), |len| at + len);
            if !query[..at].ends_with(name_char) {
                names.push(&query[at..end]);
            }
            from = end;
        }
        names
    }

    #[test]
    fn the_grafana_dashboard_uses_only_exported_metrics() {
        // One container on two GPUs, one holding: every family has samples.
        let text = render(&status());
        let exported: BTreeSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .collect();
        assert_eq!(exported.len(), 17, "{exported:?}");
        let used = check_dashboard(DASHBOARD, &exported).unwrap();
        for name in [
            "gpuplex_gpu_busy_seconds_total",
            "gpuplex_gpu_window_switches_total",
            "gpuplex_container_holding",
            "gpuplex_container_gpu_seconds_total",
            "gpuplex_container_wait_p50_seconds",
            "gpuplex_container_wait_p99_seconds",
            "gpuplex_container_memory_bytes",
        ] {
            assert!(used.contains(name), "the dashboard does not show {name}");
        }

        // A wrong name, a counter without `_total`, a panel without targets: each refused.
        let wrong = DASHBOARD.replace("gpuplex_container_holding", "gpuplex_container_holds");
        let err = check_dashboard(&wrong, &exported).unwrap_err();
        assert!(err.contains("gpuplex_container_holds"), "{err}");
        let bare = DASHBOARD.replace("gpuplex_gpu_busy_seconds_total", "gpuplex_gpu_busy_seconds");
        assert!(check_dashboard(&bare, &exported).is_err());
        let mut dashboard: serde_json::Value = serde_json::from_str(DASHBOARD).unwrap();
        dashboard["panels"][1]["targets"] = serde_json::json!([]);
        assert!(check_dashboard(&dashboard.to_string(), &exported)
            .unwrap_err()
            .contains("no target"));
        assert!(check_dashboard("{", &exported).is_err());
        assert_eq!(
            metric_names("rate(gpuplex_a_total[1m]) / my_gpuplex_c + gpuplex_d:x"),
            ["gpuplex_a_total", "gpuplex_d:x"]
        );
    }

    #[test]
    fn an_empty_node_has_only_headers() {
        let text = render(&NodeStatus::default());
        assert!(text.lines().all(|l| l.starts_with("# ")));
    }

    #[test]
    fn a_label_value_cannot_end_its_label_or_its_line() {
        let mut status = status();
        status.containers[0].pod = Some("x\"} 1\ngpuplex_forged 1\n".into());
        status.containers[0].id = "a\\\"b".into();
        let text = render(&status);
        assert!(
            !text.lines().any(|l| l.starts_with("gpuplex_forged")),
            "{text}"
        );
        assert_eq!(
            text.lines().filter(|l| !l.starts_with('#')).count(),
            6 * 2 + 11 * 2
        );
        assert!(
            text.contains(r#"container="a\\\"b",pod="x\"} 1\ngpuplex_forged 1\n""#),
            "{text}"
        );
    }

    fn get(addr: std::net::SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.write_all(request).unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        reply
    }

    #[test]
    fn serves_metrics_and_404_and_survives_garbage() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        serve(listener, Limits::default(), || Some(status())).unwrap();
        let reply = get(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        let (head, body) = reply.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.contains(&format!("Content-Type: {CONTENT_TYPE}\r\n")));
        assert!(head.contains(&format!("Content-Length: {}\r\n", body.len())));
        assert_eq!(body, render(&status()));

        let reply = get(addr, b"GET /other HTTP/1.1\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 404 Not Found\r\n"), "{reply}");
        let reply = get(addr, b"POST /metrics HTTP/1.1\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 404 "), "{reply}");
        let reply = get(addr, b"\xff\xfe\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 400 "), "{reply}");
        // A client that hangs up at once, then one that is still served.
        drop(TcpStream::connect(addr).unwrap());
        let reply = get(addr, b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n") && reply.ends_with("\r\n\r\n"));

        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        serve(listener, Limits::default(), || None).unwrap();
        let reply = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 503 "), "{reply}");
    }

    /// A connection to `to` from the loopback address `source` (all of 127/8 is local).
    fn connect_from(source: [u8; 4], to: std::net::SocketAddr) -> TcpStream {
        use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType};
        use nix::sys::socket::{SockaddrIn, SockaddrStorage};
        let fd = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let [a, b, c, d] = source;
        bind(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrIn::new(a, b, c, d, 0),
        )
        .unwrap();
        connect(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrStorage::from(to),
        )
        .unwrap();
        TcpStream::from(fd)
    }

    /// Whether the server closed `stream` (end of file or reset), without waiting.
    fn closed(mut stream: &TcpStream) -> bool {
        stream.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        !matches!(stream.read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Waits until `want` of `streams` are closed by the server, within 20 s.
    fn wait_closed(streams: &[TcpStream], want: usize) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let now = streams.iter().filter(|s| closed(s)).count();
            if now >= want || Instant::now() > deadline {
                return now;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn half_sent_requests_from_one_address_do_not_hold_up_a_scrape() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // A deadline far longer than the test: what holds a slot holds it throughout.
        let limits = Limits {
            deadline: Duration::from_secs(120),
            ..Limits::default()
        };
        serve(listener, limits, || Some(status())).unwrap();
        let attackers: Vec<TcpStream> = (0..300)
            .map(|_| {
                let mut s = connect_from([127, 0, 0, 2], addr);
                s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x").unwrap();
                s
            })
            .collect();
        // The scraper, elsewhere: answered now, not after the attackers' deadlines.
        let mut scrape = connect_from([127, 0, 0, 1], addr);
        scrape
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        scrape.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut reply = String::new();
        scrape
            .read_to_string(&mut reply)
            .expect("the scrape answered within 30 s");
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        // The attacking address's share is held; every other connection of it was closed.
        assert_eq!(wait_closed(&attackers, 300 - 8), 300 - 8);
        assert_eq!(attackers.iter().filter(|s| closed(s)).count(), 300 - 8);
    }

    #[test]
    fn connections_beyond_the_limit_in_all_are_closed_unanswered() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            deadline: Duration::from_secs(120),
            connections: 4,
            per_peer: 2,
        };
        serve(listener, limits, || Some(status())).unwrap();
        let mut held = Vec::new();
        for source in [
            [127, 0, 0, 2],
            [127, 0, 0, 2],
            [127, 0, 0, 3],
            [127, 0, 0, 3],
        ] {
            held.push(connect_from(source, addr));
        }
        let extra = [
            connect_from([127, 0, 0, 3], addr),
            connect_from([127, 0, 0, 4], addr),
        ];
        assert_eq!(wait_closed(&extra, 2), 2);
        assert_eq!(held.iter().filter(|s| closed(s)).count(), 0);
        // One finishes: its slot is free again.
        let mut first = held.remove(0);
        first.set_nonblocking(false).unwrap();
        first.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut reply = String::new();
        first.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        let deadline = Instant::now() + Duration::from_secs(20);
        // Its slot is given back just after it is answered: a connection refused meanwhile is
        // closed unanswered (or reset), and asked again.
        let try_get = || -> io::Result<String> {
            let mut stream = TcpStream::connect(addr)?;
            stream.write_all(b"GET /metrics HTTP/1.1\r\n\r\n")?;
            let mut reply = String::new();
            stream.read_to_string(&mut reply)?;
            Ok(reply)
        };
        let answered = loop {
            match try_get() {
                Ok(reply) if !reply.is_empty() => break reply,
                _ if Instant::now() > deadline => panic!("no slot given back within 20 s"),
                _ => thread::sleep(Duration::from_millis(20)),
            }
        };
        assert!(answered.starts_with("HTTP/1.1 200 OK\r\n"), "{answered}");
    }
}
