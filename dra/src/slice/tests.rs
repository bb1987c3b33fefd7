//! The slice, as the API server receives it.

use super::*;

fn gpu(index: u32, capacity: u64) -> GpuStatus {
    GpuStatus {
        index,
        uuid: format!("GPU-fake-{index}"),
        model: "Fake A100".into(),
        memory: 40 << 30,
        fake: true,
        capacity,
        healthy: true,
        unreserved: capacity,
        holder: None,
        busy_seconds: 0.0,
        switches: 0,
        containers: Vec::new(),
        reservations: Vec::new(),
    }
}

#[test]
fn each_gpu_is_a_shared_device_with_its_schedulable_memory() {
    let devices = devices(&[gpu(0, 60 << 30), gpu(1, 0), gpu(3, 40 << 30)]);
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        ["gpu-0", "gpu-3"],
        "a GPU with no memory to give is left out"
    );
    let slice = slice("node-a", devices, 4);
    let json = serde_json::to_value(&slice).unwrap();
    assert_eq!(json["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(json["kind"], "ResourceSlice");
    assert_eq!(json["metadata"]["name"], "node-a-gpuplex.io");
    assert_eq!(json["spec"]["driver"], "gpuplex.io");
    assert_eq!(json["spec"]["nodeName"], "node-a");
    assert_eq!(json["spec"]["pool"]["name"], "node-a");
    assert_eq!(json["spec"]["pool"]["generation"], 4);
    assert_eq!(json["spec"]["pool"]["resourceSliceCount"], 1);
    let d = &json["spec"]["devices"][0];
    assert_eq!(d["allowMultipleAllocations"], true);
    assert_eq!(d["attributes"]["uuid"]["string"], "GPU-fake-0");
    assert_eq!(d["attributes"]["index"]["int"], 0);
    assert_eq!(d["attributes"]["fake"]["bool"], true);
    assert_eq!(d["capacity"]["memory"]["value"], (60u64 << 30).to_string());
    let policy = &d["capacity"]["memory"]["requestPolicy"];
    assert_eq!(policy["default"], "1Gi");
    assert_eq!(policy["validRange"]["min"], "256Mi");
    assert_eq!(policy["validRange"]["step"], "256Mi");
    // What the API server would get back parses into the same slice.
    let back: ResourceSlice = serde_json::from_value(json).unwrap();
    assert_eq!(back, slice);
}

#[test]
fn eight_gpus_make_a_slice_of_a_few_kilobytes() {
    let gpus: Vec<GpuStatus> = (0..8).map(|i| gpu(i, 80 << 30)).collect();
    let bytes = serde_json::to_vec(&slice("gpu-node-17", devices(&gpus), 1)).unwrap();
    eprintln!("the slice of 8 GPUs is {} bytes of JSON", bytes.len());
    assert!(bytes.len() < 8 * 1024, "{} bytes", bytes.len());
}
