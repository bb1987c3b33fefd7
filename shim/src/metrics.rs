//! The Prometheus endpoint: [`render`] writes a [`NodeStatus`] in the text exposition format
//! (version 0.0.4), and [`serve`] answers `GET /metrics` with it.
//!
//! Labels follow dcgm-exporter, so dashboards can join the two: every series has `gpu` (the
//! index), `UUID`, `modelName` and `Hostname`; container series add `container`, `pod` and
//! `namespace` (empty when unknown). A container bound to several GPUs has one series per GPU:
//! its GPU time is split evenly between them (the status sums it over its GPUs), while its wait
//! and frozen time, windows and weight are its own and repeat on each.
//!
//! The server is deliberately small: one thread, one connection at a time, a short timeout on
//! each, `Connection: close`. It is meant for a scraper on the node or the cluster network, off
//! unless `metrics_listen` is set.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use gpuplex_scheduler::node::{ContainerState, ContainerStatus, GpuStatus, NodeStatus};

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How long one connection may take to send its request and receive the answer.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest request head read, in bytes.
const MAX_REQUEST: usize = 8 * 1024;

/// A GPU metric: name, type, help, and its value for one GPU.
type GpuMetric = (
    &'static str,
    &'static str,
    &'static str,
    fn(&GpuStatus) -> String,
);

/// A container metric: name, type, help, and its value for one container on the GPU at the
/// given position in its `gpus`.
type ContainerMetric = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ContainerStatus, usize) -> String,
);

#[rustfmt::skip]
const GPU_METRICS: [GpuMetric; 6] = [
    ("gpuplex_gpu_busy_seconds_total", "counter",
        "Seconds some container ran on the GPU with work.", |g| float(g.busy_seconds)),
    ("gpuplex_gpu_window_switches_total", "counter",
        "Windows passed on the GPU from one container to another.", |g| g.switches.to_string()),
    ("gpuplex_gpu_memory_bytes", "gauge",
        "The GPU's memory in bytes.", |g| g.memory.to_string()),
    ("gpuplex_gpu_unreserved_memory_bytes", "gauge",
        "GPU memory no container's entitlement holds, in bytes.", |g| g.unreserved.to_string()),
    ("gpuplex_gpu_containers", "gauge",
        "Containers bound to the GPU.", |g| g.containers.len().to_string()),
    ("gpuplex_gpu_fake", "gauge",
        "1 when the GPU is declared in [[fake_gpu]] rather than found by NVML.",
        |g| u8::from(g.fake).to_string()),
];

#[rustfmt::skip]
const CONTAINER_METRICS: [ContainerMetric; 7] = [
    ("gpuplex_container_gpu_seconds_total", "counter",
        "Seconds the container ran on the GPU with its window.",
        |c, _| float(c.gpu_seconds / c.gpus.len().max(1) as f64)),
    ("gpuplex_container_wait_seconds_total", "counter",
        "Seconds the container waited for a window, the current wait included.",
        |c, _| float(c.wait_seconds)),
    ("gpuplex_container_frozen_seconds_total", "counter",
        "Seconds the container's cgroup was frozen.", |c, _| float(c.frozen_seconds)),
    ("gpuplex_container_windows_total", "counter",
        "Windows the container received.", |c, _| c.windows.to_string()),
    ("gpuplex_container_frozen", "gauge",
        "1 while the container is frozen, waiting for a window.",
        |c, _| u8::from(c.state == ContainerState::Frozen).to_string()),
    ("gpuplex_container_memory_bytes", "gauge",
        "The container's memory entitlement on the GPU, in bytes.",
        |c, pos| c.memory.get(pos).copied().unwrap_or(0).to_string()),
    ("gpuplex_container_weight", "gauge",
        "The container's share weight.", |c, _| c.weight.to_string()),
];

/// The status in the Prometheus text format, every metric with its `# HELP` and `# TYPE`.
pub fn render(status: &NodeStatus) -> String {
    let host = &status.node;
    let mut out = String::new();
    for (name, kind, help, value) in GPU_METRICS {
        family(&mut out, name, kind, help);
        for g in &status.gpus {
            let labels = gpu_labels(g.index, &g.uuid, &g.model, host);
            sample(&mut out, name, &labels, &value(g));
        }
    }
    // One series per container and GPU it is bound to.
    let bound: Vec<(&ContainerStatus, usize, String)> = status
        .containers
        .iter()
        .flat_map(|c| {
            c.gpus
                .iter()
                .enumerate()
                .map(move |(pos, &index)| (c, pos, index))
        })
        .map(|(c, pos, index)| {
            let gpu = status.gpus.iter().find(|g| g.index == index);
            let (uuid, model) = gpu.map_or(("", ""), |g| (g.uuid.as_str(), g.model.as_str()));
            let labels = format!(
                "{},container=\"{}\",pod=\"{}\",namespace=\"{}\"",
                gpu_labels(index, uuid, model, host),
                escape(&c.id),
                escape(c.pod.as_deref().unwrap_or("")),
                escape(c.namespace.as_deref().unwrap_or(""))
            );
            (c, pos, labels)
        })
        .collect();
    for (name, kind, help, value) in CONTAINER_METRICS {
        family(&mut out, name, kind, help);
        for (c, pos, labels) in &bound {
            sample(&mut out, name, labels, &value(c, *pos));
        }
    }
    out
}

fn gpu_labels(index: u32, uuid: &str, model: &str, host: &str) -> String {
    format!(
        "gpu=\"{index}\",UUID=\"{}\",modelName=\"{}\",Hostname=\"{}\"",
        escape(uuid),
        escape(model),
        escape(host)
    )
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &str, value: &str) {
    let _ = writeln!(out, "{name}{{{labels}}} {value}");
}

/// A label value escaped for the text format: backslash, double quote and newline.
pub fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A sample value: Prometheus spells the special values `NaN`, `+Inf` and `-Inf`.
fn float(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        value.to_string()
    }
}

/// Answers HTTP requests on `listener` on a thread of its own, for as long as the process
/// lives: `GET` (or `HEAD`) `/metrics` with [`render`] of what `status` returns (503 when it
/// returns `None`), anything else with 404, a request line it cannot read with 400. A failed
/// connection is logged and skipped.
pub fn serve(
    listener: TcpListener,
    status: impl Fn() -> Option<NodeStatus> + Send + 'static,
) -> io::Result<thread::JoinHandle<()>> {
    thread::Builder::new()
        .name("gpuplex-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => {
                        if let Err(e) = answer(stream, &status) {
                            tracing::debug!("metrics: a connection failed: {e}");
                        }
                    }
                    Err(e) => {
                        tracing::warn!("metrics: cannot accept a connection: {e}");
                        // Out of file descriptors and the like: do not spin.
                        thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
}

fn answer(mut stream: TcpStream, status: &dyn Fn() -> Option<NodeStatus>) -> io::Result<()> {
    stream.set_read_timeout(Some(CONNECTION_TIMEOUT))?;
    stream.set_write_timeout(Some(CONNECTION_TIMEOUT))?;
    let head = read_head(&mut stream)?;
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
    stream.write_all(response.as_bytes())?;
    stream.flush()
}

/// Reads up to the blank line that ends the request head, within [`MAX_REQUEST`] bytes and
/// [`CONNECTION_TIMEOUT`] in all. A head cut short is returned as it is.
fn read_head(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let deadline = Instant::now() + CONNECTION_TIMEOUT;
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

    fn status() -> NodeStatus {
        let gpu = |index: u32, containers: &[&str]| GpuStatus {
            index,
            uuid: format!("GPU-{index}"),
            model: "Fake \"A100\"".into(),
            memory: 1000,
            fake: index == 1,
            unreserved: 400,
            holder: None,
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
                pod: Some("web\nx".into()),
                namespace: None,
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
        assert_eq!(names.len(), 13);
        for line in names {
            let name = line.split(' ').next().unwrap();
            let help = format!("# HELP {name} ");
            assert_eq!(text.matches(&help).count(), 1, "{name}");
            assert_eq!(text.matches(&format!("# TYPE {name} ")).count(), 1);
        }
        assert!(text.contains("# TYPE gpuplex_gpu_busy_seconds_total counter\n"));
        assert!(text.contains("# TYPE gpuplex_container_frozen gauge\n"));
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
            format!("gpuplex_container_frozen{{{G0},{C}}} 1"),
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
            6 * 2 + 7 * 2
        );
    }

    #[test]
    fn an_empty_node_has_only_headers() {
        let text = render(&NodeStatus::default());
        assert!(text.lines().all(|l| l.starts_with("# ")));
        assert_eq!(float(f64::NAN), "NaN");
        assert_eq!(float(f64::INFINITY), "+Inf");
        assert_eq!(float(0.0), "0");
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
        serve(listener, || Some(status())).unwrap();
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
        serve(listener, || None).unwrap();
        let reply = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.1 503 "), "{reply}");
    }
}
