//! Generates NRI's plugin API messages and ttrpc's envelope from proto/.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/nri.proto", "proto/ttrpc.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    prost_build::Config::new()
        .btree_map(["."])
        .compile_protos(&protos, &["proto"])?;
    Ok(())
}
