//! Generates the kubelet's plugin registration and DRA APIs (servers for the driver, clients
//! for the tests that play the kubelet) from proto/.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/pluginregistration.proto",
        "proto/dra_v1.proto",
        "proto/dra_v1beta1.proto",
        "proto/deviceplugin_v1beta1.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&protos, &["proto"])?;
    Ok(())
}
