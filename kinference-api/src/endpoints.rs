//! A worker set's endpoints, read from its Service's EndpointSlices.
//!
//! The router and the controller never need the core Service object: the
//! EndpointSlices of a Service (label [`SERVICE_NAME_LABEL`]) carry its
//! ready addresses and its port names with the endpoints' port numbers.
//!
//! Port rules, shared by the router and the controller so they agree:
//! - a port given by **name** resolves to the slice port of that name;
//! - a port given by **number** (or an all-digit string) must be one of the
//!   slice's port numbers, and resolves to itself;
//! - a slice that lists no ports (allowed for selector-less Services) lets a
//!   number through and refuses a name.
//!
//! Endpoints are ready unless their `ready` condition is `false` (a missing
//! condition means ready, as the EndpointSlice API defines). One pod that
//! appears in several slices (e.g. IPv4 and IPv6) counts once: endpoints are
//! deduplicated by their target reference when they have one, else by
//! address.

use std::collections::BTreeSet;

use k8s_openapi::api::discovery::v1::{EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// The label tying an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Whether `slice` belongs to the Service `service`.
pub fn belongs_to(slice: &EndpointSlice, service: &str) -> bool {
    slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .is_some_and(|s| s == service)
}

/// A port that does not resolve against a slice's ports.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    /// No slice port has this name.
    #[error("the Service has no port named {name:?} (its ports: {available})")]
    UnknownName {
        /// The name asked for.
        name: String,
        /// The ports the slices list, for the message.
        available: String,
    },
    /// No slice port has this number.
    #[error("the Service's endpoints have no port {number} (their ports: {available})")]
    UnknownNumber {
        /// The number asked for.
        number: i32,
        /// The ports the slices list, for the message.
        available: String,
    },
    /// Not a usable port number.
    #[error("{0} is not a port number from 1 to 65535")]
    OutOfRange(i64),
}

/// A port reference read as a number when it is one (an all-digit string
/// included), else as a name.
fn as_number(port: &IntOrString) -> Option<i64> {
    match port {
        IntOrString::Int(n) => Some(i64::from(*n)),
        IntOrString::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            s.parse().ok().or(Some(i64::MAX))
        }
        IntOrString::String(_) => None,
    }
}

fn describe(ports: &[EndpointPort]) -> String {
    if ports.is_empty() {
        return "none listed".into();
    }
    ports
        .iter()
        .map(|p| match (&p.name, p.port) {
            (Some(n), Some(num)) if !n.is_empty() => format!("{n}={num}"),
            (_, Some(num)) => num.to_string(),
            (Some(n), None) => n.clone(),
            (None, None) => "?".into(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Resolves `port` against one slice's ports.
///
/// # Errors
/// [`PortError`] when the name or number is not among them.
pub fn resolve_port(port: &IntOrString, ports: &[EndpointPort]) -> Result<u16, PortError> {
    if let Some(n) = as_number(port) {
        let number = u16::try_from(n)
            .ok()
            .filter(|p| *p != 0)
            .ok_or(PortError::OutOfRange(n))?;
        if ports.is_empty() || ports.iter().any(|p| p.port == Some(i32::from(number))) {
            return Ok(number);
        }
        return Err(PortError::UnknownNumber {
            number: i32::from(number),
            available: describe(ports),
        });
    }
    let IntOrString::String(name) = port else {
        unreachable!("as_number handles Int")
    };
    ports
        .iter()
        .find(|p| p.name.as_deref() == Some(name.as_str()))
        .and_then(|p| p.port)
        .and_then(|n| u16::try_from(n).ok())
        .ok_or_else(|| PortError::UnknownName {
            name: name.clone(),
            available: describe(ports),
        })
}

/// One ready endpoint of a worker set.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReadyEndpoint {
    /// IP address (or FQDN for FQDN slices).
    pub address: String,
    /// The OpenAI API port (`serviceRef.port`, resolved).
    pub http_port: u16,
    /// The KV-event PUB port (`kvEvents.port`, resolved), when set and resolvable.
    pub kv_port: Option<u16>,
    /// The KV-event replay port (`kvEvents.replayPort`, resolved), when set
    /// and resolvable.
    pub replay_port: Option<u16>,
    /// The pod (or other object) behind it, when the slice names one.
    pub target: Option<String>,
}

/// What a worker set's slices say, with the problems found on the way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Endpoints {
    /// Ready endpoints, deduplicated and sorted.
    pub ready: Vec<ReadyEndpoint>,
    /// Endpoints listed but not ready.
    pub not_ready: usize,
    /// `serviceRef.port` problems, one per slice that could not resolve it.
    pub http_port_errors: Vec<PortError>,
    /// `kvEvents.port` problems, one per slice that could not resolve it.
    pub kv_port_errors: Vec<PortError>,
    /// Number of slices seen.
    pub slices: usize,
}

/// Reads the ready endpoints of the slices of one Service.
///
/// `slices` should already be those of the worker set's Service (see
/// [`belongs_to`]). Endpoints of a slice whose HTTP port does not resolve are
/// left out (and the error recorded); a KV or replay port that does not
/// resolve leaves `kv_port` or `replay_port` empty (and the error recorded).
pub fn read<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    http_port: &IntOrString,
    kv_port: Option<&IntOrString>,
    replay_port: Option<&IntOrString>,
) -> Endpoints {
    let mut out = Endpoints::default();
    let mut seen = BTreeSet::new();
    for slice in slices {
        out.slices += 1;
        let ports = slice.ports.as_deref().unwrap_or_default();
        let http = match resolve_port(http_port, ports) {
            Ok(p) => p,
            Err(e) => {
                out.http_port_errors.push(e);
                continue;
            }
        };
        let kv = kv_port.and_then(|k| {
            resolve_port(k, ports)
                .map_err(|e| out.kv_port_errors.push(e))
                .ok()
        });
        // A replay port number is the pod's own (replay sockets are seldom
        // Service ports); a name must be one of the slice's.
        let replay = replay_port.and_then(|k| {
            let listed = match as_number(k) {
                Some(n) => u16::try_from(n)
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or(PortError::OutOfRange(n)),
                None => resolve_port(k, ports),
            };
            listed.map_err(|e| out.kv_port_errors.push(e)).ok()
        });
        for ep in &slice.endpoints {
            let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            let Some(address) = ep.addresses.first() else {
                continue;
            };
            if !ready {
                out.not_ready += 1;
                continue;
            }
            let target = ep.target_ref.as_ref().and_then(|t| {
                t.name
                    .as_ref()
                    .map(|n| format!("{}/{n}", t.kind.as_deref().unwrap_or("")))
            });
            let identity = target.clone().unwrap_or_else(|| address.clone());
            if !seen.insert((identity, http)) {
                continue;
            }
            out.ready.push(ReadyEndpoint {
                address: address.clone(),
                http_port: http,
                kv_port: kv,
                replay_port: replay,
                target,
            });
        }
    }
    out.ready.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions};

    fn port(name: &str, n: i32) -> EndpointPort {
        EndpointPort {
            name: Some(name.into()),
            port: Some(n),
            ..Default::default()
        }
    }

    fn ep(addr: &str, ready: Option<bool>, pod: Option<&str>) -> Endpoint {
        Endpoint {
            addresses: vec![addr.into()],
            conditions: Some(EndpointConditions {
                ready,
                ..Default::default()
            }),
            target_ref: pod.map(|p| ObjectReference {
                kind: Some("Pod".into()),
                name: Some(p.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn slice(ports: Vec<EndpointPort>, endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".into(),
            endpoints,
            ports: Some(ports),
            ..Default::default()
        }
    }

    #[test]
    fn ports_resolve_by_name_or_number() {
        let ports = [port("http", 8000), port("kv-pub", 5557)];
        let s = |x: &str| IntOrString::String(x.into());
        assert_eq!(resolve_port(&s("http"), &ports), Ok(8000));
        assert_eq!(resolve_port(&IntOrString::Int(5557), &ports), Ok(5557));
        assert_eq!(resolve_port(&s("5557"), &ports), Ok(5557));
        assert!(matches!(
            resolve_port(&s("grpc"), &ports),
            Err(PortError::UnknownName { .. })
        ));
        let err = resolve_port(&IntOrString::Int(9000), &ports).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the Service's endpoints have no port 9000 (their ports: http=8000, kv-pub=5557)"
        );
        assert_eq!(
            resolve_port(&IntOrString::Int(70000), &ports),
            Err(PortError::OutOfRange(70000))
        );
        // No ports listed: numbers pass, names do not.
        assert_eq!(resolve_port(&IntOrString::Int(80), &[]), Ok(80));
        assert!(resolve_port(&s("http"), &[]).is_err());
    }

    #[test]
    fn ready_endpoints_are_deduplicated_across_slices() {
        let ports = vec![port("http", 8000), port("kv-pub", 5557)];
        let a = slice(
            ports.clone(),
            vec![
                ep("10.0.0.1", Some(true), Some("p1")),
                ep("10.0.0.2", None, Some("p2")),
                ep("10.0.0.3", Some(false), Some("p3")),
            ],
        );
        // The same pod p1 again in another slice, plus a new one.
        let b = slice(
            ports,
            vec![
                ep("10.0.0.1", Some(true), Some("p1")),
                ep("10.0.0.4", Some(true), None),
            ],
        );
        let eps = read(
            [&a, &b],
            &IntOrString::String("http".into()),
            Some(&IntOrString::String("kv-pub".into())),
            None,
        );
        let addrs: Vec<&str> = eps.ready.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(addrs, ["10.0.0.1", "10.0.0.2", "10.0.0.4"]);
        assert!(
            eps.ready
                .iter()
                .all(|e| e.kv_port == Some(5557) && e.http_port == 8000)
        );
        assert_eq!(eps.not_ready, 1);
        assert_eq!(eps.slices, 2);
        assert!(eps.http_port_errors.is_empty() && eps.kv_port_errors.is_empty());
    }

    #[test]
    fn replay_ports_resolve_by_name_or_number() {
        let s = slice(
            vec![
                port("http", 8000),
                port("kv-pub", 5557),
                port("kv-replay", 5558),
            ],
            vec![ep("10.0.0.1", Some(true), None)],
        );
        let kv = IntOrString::String("kv-pub".into());
        let by_name = read(
            [&s],
            &IntOrString::String("http".into()),
            Some(&kv),
            Some(&IntOrString::String("kv-replay".into())),
        );
        assert_eq!(by_name.ready[0].replay_port, Some(5558));
        let by_number = read(
            [&s],
            &IntOrString::Int(8000),
            Some(&kv),
            Some(&IntOrString::Int(6000)),
        );
        assert_eq!(by_number.ready[0].replay_port, Some(6000));
        let missing = read(
            [&s],
            &IntOrString::Int(8000),
            Some(&kv),
            Some(&IntOrString::String("nope".into())),
        );
        assert_eq!(missing.ready[0].replay_port, None);
        assert_eq!(
            missing.kv_port_errors.len(),
            1,
            "an unresolvable replay port is reported"
        );
    }

    #[test]
    fn unresolvable_ports_are_reported() {
        let s = slice(
            vec![port("http", 8000)],
            vec![ep("10.0.0.1", Some(true), None)],
        );
        let eps = read(
            [&s],
            &IntOrString::String("http".into()),
            Some(&IntOrString::String("kv-pub".into())),
            None,
        );
        assert_eq!(eps.ready.len(), 1);
        assert_eq!(eps.ready[0].kv_port, None);
        assert_eq!(eps.kv_port_errors.len(), 1);

        let eps = read([&s], &IntOrString::String("openai".into()), None, None);
        assert!(eps.ready.is_empty());
        assert_eq!(eps.http_port_errors.len(), 1);
    }

    #[test]
    fn slice_membership_is_by_label() {
        let mut s = slice(vec![], vec![]);
        assert!(!belongs_to(&s, "qwen"));
        s.metadata.labels = Some([(SERVICE_NAME_LABEL.to_owned(), "qwen".to_owned())].into());
        assert!(belongs_to(&s, "qwen"));
        assert!(!belongs_to(&s, "gemma"));
    }
}
