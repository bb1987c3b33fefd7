//! The ResourceSlice this node publishes for `gpuplex.io`: one pool named after the node, one
//! device per GPU (`gpu-<index>`) with its identity as attributes and its schedulable memory as
//! consumable capacity, shared among claims (`allowMultipleAllocations`). kube-scheduler counts
//! each claim's `memory` against that capacity, per GPU. Pure: the node's GPUs in, the slice out.
//!
//! A claim that names no memory consumes [`DEFAULT_MEMORY`]; any request is rounded up to a
//! multiple of [`MEMORY_STEP`], at least [`MIN_MEMORY`]: the request policy kube-scheduler
//! applies before it counts.

use std::collections::BTreeMap;

use gpuplex_scheduler::node::GpuStatus;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::claim::{device_name, DRIVER, MEMORY};

/// What a claim that names no memory consumes.
pub const DEFAULT_MEMORY: &str = "1Gi";
/// The least a claim consumes.
pub const MIN_MEMORY: &str = "256Mi";
/// The granularity of what claims consume.
pub const MEMORY_STEP: &str = "256Mi";

/// The name of node `node`'s slice.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

/// The devices of node's GPUs (those with schedulable memory).
pub fn devices(gpus: &[GpuStatus]) -> Vec<Device> {
    gpus.iter()
        .filter(|g| g.capacity > 0)
        .map(|g| {
            let attributes = BTreeMap::from([
                ("uuid".to_owned(), string(&g.uuid)),
                ("model".to_owned(), string(&g.model)),
                (
                    "index".to_owned(),
                    DeviceAttribute {
                        int: Some(g.index.into()),
                        ..DeviceAttribute::default()
                    },
                ),
                (
                    "fake".to_owned(),
                    DeviceAttribute {
                        bool: Some(g.fake),
                        ..DeviceAttribute::default()
                    },
                ),
            ]);
            let memory = DeviceCapacity {
                value: Quantity(g.capacity.to_string()),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(Quantity(DEFAULT_MEMORY.into())),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: Quantity(MIN_MEMORY.into()),
                        max: None,
                        step: Some(Quantity(MEMORY_STEP.into())),
                    }),
                    valid_values: None,
                }),
            };
            Device {
                name: device_name(g.index),
                attributes: Some(attributes),
                capacity: Some(BTreeMap::from([(MEMORY.to_owned(), memory)])),
                allow_multiple_allocations: Some(true),
                ..Device::default()
            }
        })
        .collect()
}

/// Node `node`'s slice with these devices, at pool generation `generation`.
pub fn slice(node: &str, devices: Vec<Device>, generation: i64) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node)),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool {
                name: node.to_owned(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        },
    }
}

fn string(value: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.to_owned()),
        ..DeviceAttribute::default()
    }
}

#[cfg(test)]
mod tests;
