//! `gpuplexctl status` as text: [`render_status`], a pure function of a [`NodeStatus`].
//!
//! ```text
//! node gpu-7  activity cpu  (fake GPUs)
//! GPU 0  Fake A100  GPU-0  28GiB/40GiB  holder: job-a  busy 12.5s  switches 4
//!   * job-a  vgpu-1  w=1 normal  running                 gpu 10.0s  wait 2.0s  frozen 1.5s  windows 3  lag -0.120s
//!     job-b  vgpu-2  w=2 high    frozen (waiting 0.4s)   gpu 4.0s   wait 6.0s  frozen 5.0s  windows 2  lag +0.000s
//!     reserved  vgpu-3  w=1 normal  4GiB  expires in 25.0s
//! ```

use gpuplex_scheduler::node::{ContainerState, ContainerStatus, NodeStatus};

/// A container id as people read it: the first 12 characters of a long hexadecimal id (as
/// `podman ps` and `docker ps` show them), any other id whole. `-o json` keeps the full ids.
pub fn short_id(id: &str) -> &str {
    if id.len() >= 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        &id[..12]
    } else {
        id
    }
}

/// The status as aligned text, one line per GPU, container and reservation, newline-terminated.
pub fn render_status(status: &NodeStatus) -> String {
    let mut out = String::new();
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    out.push_str(&format!(
        "node {}  activity {}",
        dash(&status.node),
        dash(&status.activity)
    ));
    if status.gpus.iter().any(|g| g.fake) {
        out.push_str("  (fake GPUs)");
    }
    out.push('\n');
    if !status.cdi.is_empty() {
        out.push_str(&format!("CDI: {}\n", status.cdi));
    }
    if status.gpus.is_empty() {
        out.push_str("no GPUs\n");
        return out;
    }

    let gpu_rows: Vec<Vec<String>> = status
        .gpus
        .iter()
        .map(|g| {
            vec![
                format!("GPU {}", g.index),
                g.model.clone(),
                g.uuid.clone(),
                format!(
                    "{}/{}",
                    bytes(g.memory.saturating_sub(g.unreserved)),
                    bytes(g.memory)
                ),
                format!("holder: {}", g.holder.as_deref().map_or("-", short_id)),
                format!("busy {}", seconds(g.busy_seconds)),
                format!("switches {}", g.switches),
            ]
        })
        .collect();
    // One container row per GPU it is bound to; one width for all, so the columns line up
    // across GPUs.
    let container_rows: Vec<Vec<Vec<String>>> = status
        .gpus
        .iter()
        .map(|g| {
            g.containers
                .iter()
                .map(|id| {
                    let holder = g.holder.as_deref() == Some(id.as_str());
                    let found = status.containers.iter().find(|c| &c.id == id);
                    container_row(short_id(id), holder, found)
                })
                .collect()
        })
        .collect();
    let reservation_rows: Vec<Vec<Vec<String>>> = status
        .gpus
        .iter()
        .map(|g| {
            g.reservations
                .iter()
                .map(|vgpu| {
                    let found = status.reservations.iter().find(|r| &r.vgpu == vgpu);
                    let mut row = vec!["  reserved".to_string(), vgpu.clone()];
                    if let Some(r) = found {
                        let pos = r.gpus.iter().position(|&i| i == g.index);
                        let memory = pos.and_then(|p| r.memory.get(p)).copied().unwrap_or(0);
                        row.extend([
                            format!("w={} {}", r.weight, r.priority),
                            bytes(memory),
                            match &r.claim {
                                Some(claim) => format!("claim {claim}"),
                                None => format!("expires in {}", seconds(r.expires_in_seconds)),
                            },
                        ]);
                    }
                    row
                })
                .collect()
        })
        .collect();
    let gpu_widths = widths(gpu_rows.iter());
    let container_widths = widths(container_rows.iter().flatten());
    let reservation_widths = widths(reservation_rows.iter().flatten());
    for (i, gpu_row) in gpu_rows.iter().enumerate() {
        line(&mut out, gpu_row, &gpu_widths);
        for row in &container_rows[i] {
            line(&mut out, row, &container_widths);
        }
        for row in &reservation_rows[i] {
            line(&mut out, row, &reservation_widths);
        }
        if container_rows[i].is_empty() && reservation_rows[i].is_empty() {
            out.push_str("  no containers\n");
        }
    }
    out
}

fn container_row(id: &str, holder: bool, found: Option<&ContainerStatus>) -> Vec<String> {
    let marker = if holder { "* " } else { "  " };
    let mut row = vec![format!("  {marker}{id}")];
    let Some(c) = found else {
        row.push("(no status)".into());
        return row;
    };
    let state = match c.state {
        ContainerState::Frozen => format!("frozen (waiting {})", seconds(c.waiting_seconds)),
        other => other.name().to_string(),
    };
    row.extend([
        c.vgpu.clone(),
        format!("w={} {}", c.weight, c.priority),
        state,
        format!("gpu {}", seconds(c.gpu_seconds)),
        format!("wait {}", seconds(c.wait_seconds)),
        format!("frozen {}", seconds(c.frozen_seconds)),
        format!("windows {}", c.windows),
        format!("lag {:+.3}s", c.lag_seconds),
    ]);
    row
}

/// The widest cell of each column.
fn widths<'a>(rows: impl Iterator<Item = &'a Vec<String>>) -> Vec<usize> {
    let mut widths: Vec<usize> = Vec::new();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            let width = cell.chars().count();
            match widths.get_mut(i) {
                Some(w) => *w = (*w).max(width),
                None => widths.push(width),
            }
        }
    }
    widths
}

/// One row, its cells padded to `widths` and two spaces apart, without trailing blanks.
fn line(out: &mut String, row: &[String], widths: &[usize]) {
    let mut text = String::new();
    for (i, cell) in row.iter().enumerate() {
        if i > 0 {
            text.push_str("  ");
        }
        text.push_str(cell);
        let pad = widths.get(i).copied().unwrap_or(0);
        for _ in cell.chars().count()..pad {
            text.push(' ');
        }
    }
    out.push_str(text.trim_end());
    out.push('\n');
}

/// Seconds with one decimal: `12.5s`.
pub fn seconds(value: f64) -> String {
    format!("{value:.1}s")
}

/// Bytes in binary units, whole when they divide evenly: `40GiB`, `1.5GiB`, `512B`.
pub fn bytes(value: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && value >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    let size = 1u64 << (10 * unit);
    if value % size == 0 {
        format!("{}{}", value / size, UNITS[unit])
    } else {
        format!("{:.1}{}", value as f64 / size as f64, UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_hex_ids_are_cut_like_podman_ps() {
        let id = "cdff5c7b6375924cfaaef98643cbcc159f71ee1ac71b9fb7470a289d0c3a1dd9";
        assert_eq!(super::short_id(id), "cdff5c7b6375");
        assert_eq!(super::short_id("job-a"), "job-a");
        assert_eq!(super::short_id("deadbeef"), "deadbeef");
    }

    use super::*;
    use gpuplex_scheduler::node::{GpuStatus, ReservationStatus};
    use gpuplex_scheduler::request::Priority;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, containers: &[&str], holder: Option<&str>) -> GpuStatus {
        GpuStatus {
            index,
            uuid: format!("GPU-{index}"),
            model: "Fake A100".into(),
            memory: 40 * GIB,
            fake: false,
            capacity: 0,
            healthy: true,
            unreserved: 40 * GIB,
            holder: holder.map(String::from),
            busy_seconds: 0.0,
            switches: 0,
            containers: containers.iter().map(|c| c.to_string()).collect(),
            reservations: vec![],
        }
    }

    fn container(id: &str, vgpu: &str, state: ContainerState) -> ContainerStatus {
        ContainerStatus {
            id: id.into(),
            vgpu: vgpu.into(),
            gpus: vec![0],
            memory: vec![8 * GIB],
            weight: 1,
            priority: Priority::Normal,
            state,
            gpu_seconds: 0.0,
            wait_seconds: 0.0,
            waiting_seconds: 0.0,
            frozen_seconds: 0.0,
            windows: 0,
            lag_seconds: 0.0,
            wait_p50_seconds: 0.0,
            wait_p99_seconds: 0.0,
            pod: None,
            namespace: None,
            claim: None,
        }
    }

    #[test]
    fn empty_node() {
        assert_eq!(
            render_status(&NodeStatus::default()),
            "node -  activity -\nno GPUs\n"
        );
    }

    #[test]
    fn gpu_without_containers() {
        let status = NodeStatus {
            node: "n1".into(),
            activity: "nvml".into(),
            gpus: vec![gpu(0, &[], None)],
            ..NodeStatus::default()
        };
        assert_eq!(
            render_status(&status),
            "node n1  activity nvml\n\
             GPU 0  Fake A100  GPU-0  0B/40GiB  holder: -  busy 0.0s  switches 0\n  \
             no containers\n"
        );
    }

    #[test]
    fn fake_gpus_holder_frozen_idle_and_a_reservation() {
        let mut g0 = gpu(0, &["job-a", "job-b"], Some("job-a"));
        g0.fake = true;
        g0.unreserved = 12 * GIB;
        g0.busy_seconds = 12.5;
        g0.switches = 4;
        g0.reservations = vec!["vgpu-3".into()];
        let g1 = gpu(1, &["job-c"], None);
        let mut a = container("job-a", "vgpu-1", ContainerState::Running);
        a.gpu_seconds = 10.0;
        a.wait_seconds = 2.0;
        a.frozen_seconds = 1.5;
        a.windows = 3;
        let mut b = container("job-b", "vgpu-2", ContainerState::Frozen);
        b.weight = 2;
        b.priority = Priority::High;
        b.gpu_seconds = 4.0;
        b.wait_seconds = 6.0;
        b.waiting_seconds = 0.44;
        b.frozen_seconds = 5.0;
        b.windows = 2;
        let mut c = container("job-c", "vgpu-4", ContainerState::Idle);
        c.gpus = vec![1];
        let status = NodeStatus {
            node: "gpu-7".into(),
            activity: "cpu".into(),
            cdi: "nvidia.com/gpu from /etc/cdi/nvidia.yaml".into(),
            gpus: vec![g0, g1],
            containers: vec![a, b, c],
            reservations: vec![ReservationStatus {
                vgpu: "vgpu-3".into(),
                gpus: vec![0],
                memory: vec![4 * GIB],
                weight: 1,
                priority: Priority::Low,
                expires_in_seconds: 25.04,
                claim: None,
            }],
        };
        let expected = "\
node gpu-7  activity cpu  (fake GPUs)
CDI: nvidia.com/gpu from /etc/cdi/nvidia.yaml
GPU 0  Fake A100  GPU-0  28GiB/40GiB  holder: job-a  busy 12.5s  switches 4
  * job-a  vgpu-1  w=1 normal  running                gpu 10.0s  wait 2.0s  frozen 1.5s  windows 3  lag +0.000s
    job-b  vgpu-2  w=2 high    frozen (waiting 0.4s)  gpu 4.0s   wait 6.0s  frozen 5.0s  windows 2  lag +0.000s
  reserved  vgpu-3  w=1 low  4GiB  expires in 25.0s
GPU 1  Fake A100  GPU-1  0B/40GiB     holder: -      busy 0.0s   switches 0
    job-c  vgpu-4  w=1 normal  idle                   gpu 0.0s   wait 0.0s  frozen 0.0s  windows 0  lag +0.000s
";
        assert_eq!(render_status(&status), expected);
    }

    #[test]
    fn a_container_without_status_still_shows() {
        let status = NodeStatus {
            gpus: vec![gpu(0, &["ghost"], Some("ghost"))],
            ..NodeStatus::default()
        };
        assert!(render_status(&status).ends_with("\n  * ghost  (no status)\n"));
    }

    #[test]
    fn units() {
        assert_eq!(bytes(0), "0B");
        assert_eq!(bytes(512), "512B");
        assert_eq!(bytes(1536), "1.5KiB");
        assert_eq!(bytes(80 * GIB), "80GiB");
        assert_eq!(bytes(GIB + GIB / 2), "1.5GiB");
        assert_eq!(seconds(0.04), "0.0s");
        assert_eq!(seconds(3725.25), "3725.2s");
    }
}
