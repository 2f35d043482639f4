//! Builders of the objects kinference reads, for tests (feature
//! `test-util`): worker sets, pools and EndpointSlices with the fields tests
//! set, everything else empty. Namespaced objects go to [`NAMESPACE`] unless
//! a builder takes one.

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::core::ObjectMeta;

use crate::endpoints::SERVICE_NAME_LABEL;
use crate::v1alpha1::{
    InferencePoolSpec, InferenceWorkerSetSpec, KvEventsRef, ModelSpec, ServiceRef, WorkerSetRef,
};
use crate::{InferencePool, InferenceWorkerSet};

/// The namespace of test objects.
pub const NAMESPACE: &str = "ns";

/// A port reference: a number when `p` parses as one, else a name.
pub fn port(p: &str) -> IntOrString {
    match p.parse::<i32>() {
        Ok(n) => IntOrString::Int(n),
        Err(_) => IntOrString::String(p.to_owned()),
    }
}

/// `secs` after the Unix epoch, as Kubernetes times are written.
pub fn at(secs: i64) -> Time {
    Time(Timestamp::from_second(secs).expect("a valid time"))
}

/// A worker-set spec with profile `default`, kvBlockSize 16, the Service and
/// ports given (names or numbers), and `models` as (name, aliases).
pub fn mk_spec(
    service: &str,
    http: &str,
    kv: Option<&str>,
    models: &[(&str, &[&str])],
) -> InferenceWorkerSetSpec {
    InferenceWorkerSetSpec {
        profile: "default".into(),
        kv_block_size: 16,
        service_ref: ServiceRef {
            name: service.into(),
            port: port(http),
        },
        kv_events: kv.map(|k| KvEventsRef {
            port: port(k),
            replay_port: None,
        }),
        models: models
            .iter()
            .map(|(name, aliases)| ModelSpec {
                name: (*name).into(),
                aliases: aliases.iter().map(|a| (*a).to_owned()).collect(),
            })
            .collect(),
    }
}

/// A worker set in [`NAMESPACE`], created at `created` (seconds), generation 1.
pub fn mk_ws(name: &str, created: i64, spec: InferenceWorkerSetSpec) -> InferenceWorkerSet {
    let mut ws = InferenceWorkerSet::new(name, spec);
    ws.metadata = ObjectMeta {
        name: Some(name.into()),
        namespace: Some(NAMESPACE.into()),
        generation: Some(1),
        creation_timestamp: Some(at(created)),
        ..Default::default()
    };
    ws
}

/// A pool in [`NAMESPACE`] naming `sets`, generation 1.
pub fn mk_pool(name: &str, sets: &[&str]) -> InferencePool {
    let mut pool = InferencePool::new(
        name,
        InferencePoolSpec {
            worker_sets: sets
                .iter()
                .map(|s| WorkerSetRef { name: (*s).into() })
                .collect(),
        },
    );
    pool.metadata.namespace = Some(NAMESPACE.into());
    pool.metadata.generation = Some(1);
    pool
}

/// An EndpointSlice of `service` in [`NAMESPACE`] with `ports` (name,
/// number) and `endpoints` (address, ready).
pub fn mk_slice(
    name: &str,
    service: &str,
    ports: &[(&str, i32)],
    endpoints: &[(&str, Option<bool>)],
) -> EndpointSlice {
    mk_slice_in(NAMESPACE, name, service, ports, endpoints)
}

/// [`mk_slice`] in namespace `ns` (for objects sent to a real API server).
pub fn mk_slice_in(
    ns: &str,
    name: &str,
    service: &str,
    ports: &[(&str, i32)],
    endpoints: &[(&str, Option<bool>)],
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some([(SERVICE_NAME_LABEL.to_owned(), service.to_owned())].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        ports: Some(
            ports
                .iter()
                .map(|(n, p)| EndpointPort {
                    name: Some((*n).to_owned()),
                    port: Some(*p),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                })
                .collect(),
        ),
        endpoints: endpoints
            .iter()
            .map(|(a, ready)| Endpoint {
                addresses: vec![(*a).to_owned()],
                conditions: Some(EndpointConditions {
                    ready: *ready,
                    serving: *ready,
                    terminating: ready.map(|_| false),
                }),
                ..Default::default()
            })
            .collect(),
    }
}
