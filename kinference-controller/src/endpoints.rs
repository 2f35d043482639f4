//! A worker set's endpoints, as its Service's EndpointSlices describe them.
//!
//! Pure: slices in, [`Resolution`] out. A Service's slices carry the label
//! `kubernetes.io/service-name`; their `ports[].name` are the Service's port
//! names and `ports[].port` the numbers the endpoints listen on, so a port
//! given by name or by number is resolved here without the core Service.
//!
//! # Rules
//!
//! - A port reference matches a slice port by name (a string reference) or by
//!   number (an integer reference, or a string of digits). A slice port
//!   without a number means "all ports" and matches every number.
//! - An endpoint is *ready* unless `conditions.ready` is `false` (Kubernetes
//!   says an unset `ready` means ready), and it is *routable* when its slice
//!   carries the serving port. `ready` counts endpoints both ready and routable.
//! - Endpoints are deduplicated across slices by their `targetRef` (kind,
//!   namespace, name) when they have one, else by their first address; an
//!   endpoint listed twice is ready when any listing says so.
//!
//! Cost: O(slices × (ports + endpoints)) per call, plus sorting the result.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::{EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// How a port reference fared against the slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortLookup {
    /// No slice exists for the Service: nothing can be judged yet.
    NoSlices,
    /// At least one slice carries the port.
    Found,
    /// Slices exist and none carries the port.
    Missing,
}

/// One routable endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The deduplication key: `Kind/namespace/name` of the target, or the address.
    pub key: String,
    /// The address to connect to (IPv4, IPv6 or a DNS name).
    pub address: String,
    /// The serving (OpenAI API) port number.
    pub http_port: u16,
    /// The KV-event port number, when `kvEvents` is set and this endpoint's
    /// slice carries it.
    pub kv_port: Option<u16>,
}

impl Endpoint {
    /// `host:port` of the OpenAI API (IPv6 in brackets).
    pub fn http_authority(&self) -> String {
        authority(&self.address, self.http_port)
    }

    /// `host:port` of the KV-event publisher, if known.
    pub fn kv_authority(&self) -> Option<String> {
        self.kv_port.map(|p| authority(&self.address, p))
    }
}

/// `host:port`, with an IPv6 host in brackets.
pub fn authority(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => format!("[{host}]:{port}"),
        _ => format!("{host}:{port}"),
    }
}

/// What the slices say about one worker set's Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolution {
    /// How many slices the Service has.
    pub slices: usize,
    /// Ready, routable endpoints, sorted by key.
    pub ready: Vec<Endpoint>,
    /// Endpoints listed but not ready (deduplicated).
    pub not_ready: usize,
    /// The serving port (`serviceRef.port`).
    pub http_port: PortLookup,
    /// The KV port (`kvEvents.port`); `None` when `kvEvents` is unset.
    pub kv_port: Option<PortLookup>,
    /// Some slice resolves both ports to the same number.
    pub same_port: Option<u16>,
    /// The ports the slices list, as `name:number` (or just one of them),
    /// sorted and deduplicated: for messages.
    pub ports: Vec<String>,
}

impl Resolution {
    /// Ready endpoints whose slice lacks the KV port although `kvEvents` is set.
    pub fn ready_without_kv_port(&self) -> impl Iterator<Item = &Endpoint> {
        let kv_set = self.kv_port.is_some();
        self.ready
            .iter()
            .filter(move |e| kv_set && e.kv_port.is_none())
    }
}

/// A port reference (`serviceRef.port`, `kvEvents.port`) in a usable form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRef {
    /// By number.
    Number(i32),
    /// By the Service's port name.
    Name(String),
}

impl PortRef {
    /// Reads an `IntOrString`; a string of digits is a number, as the CRD's
    /// validation rule says.
    pub fn from_int_or_string(port: &IntOrString) -> Self {
        match port {
            IntOrString::Int(n) => PortRef::Number(*n),
            IntOrString::String(s) => match s.parse::<i32>() {
                Ok(n) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
                    PortRef::Number(n)
                }
                _ => PortRef::Name(s.clone()),
            },
        }
    }

    /// The port number this reference picks among `ports`, if any.
    fn resolve(&self, ports: &[EndpointPort]) -> Option<u16> {
        ports.iter().find_map(|p| match self {
            PortRef::Number(n) => match p.port {
                Some(q) if q == *n => u16::try_from(q).ok(),
                None => u16::try_from(*n).ok(),
                Some(_) => None,
            },
            PortRef::Name(name) => {
                if p.name.as_deref() == Some(name.as_str()) {
                    p.port.and_then(|q| u16::try_from(q).ok())
                } else {
                    None
                }
            }
        })
    }
}

impl std::fmt::Display for PortRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PortRef::Number(n) => write!(f, "{n}"),
            PortRef::Name(s) => write!(f, "{s:?}"),
        }
    }
}

/// Whether `slice` belongs to the Service `service`.
pub fn belongs_to(slice: &EndpointSlice, service: &str) -> bool {
    slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .is_some_and(|s| s == service)
}

/// The Service a slice belongs to, from its label.
pub fn service_of(slice: &EndpointSlice) -> Option<&str> {
    slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .map(String::as_str)
}

/// Resolves a worker set's endpoints from `slices` (any slices: those of
/// other Services are ignored).
pub fn resolve<'a>(
    service: &str,
    http: &PortRef,
    kv: Option<&PortRef>,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
) -> Resolution {
    struct Seen {
        address: String,
        ready: bool,
        http_port: Option<u16>,
        kv_port: Option<u16>,
    }
    let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
    let mut count = 0;
    let mut http_found = false;
    let mut kv_found = false;
    let mut same_port = None;
    let mut port_names = std::collections::BTreeSet::new();
    for slice in slices.into_iter().filter(|s| belongs_to(s, service)) {
        count += 1;
        let ports = slice.ports.as_deref().unwrap_or_default();
        port_names.extend(ports.iter().map(describe_port));
        let http_port = http.resolve(ports);
        let kv_port = kv.and_then(|k| k.resolve(ports));
        http_found |= http_port.is_some();
        kv_found |= kv_port.is_some();
        if let (Some(h), Some(k)) = (http_port, kv_port)
            && h == k
        {
            same_port = Some(h);
        }
        for ep in &slice.endpoints {
            let Some(address) = ep.addresses.first() else {
                continue;
            };
            let key = ep.target_ref.as_ref().and_then(|r| {
                r.name.as_ref().map(|n| {
                    format!(
                        "{}/{}/{}",
                        r.kind.as_deref().unwrap_or_default(),
                        r.namespace.as_deref().unwrap_or_default(),
                        n
                    )
                })
            });
            let key = key.unwrap_or_else(|| address.clone());
            let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            let entry = seen.entry(key).or_insert_with(|| Seen {
                address: address.clone(),
                ready: false,
                http_port: None,
                kv_port: None,
            });
            // Prefer the listing that is ready and routable.
            if ready && http_port.is_some() && !(entry.ready && entry.http_port.is_some()) {
                entry.address.clone_from(address);
                entry.http_port = http_port;
                entry.kv_port = kv_port;
            } else {
                entry.http_port = entry.http_port.or(http_port);
                entry.kv_port = entry.kv_port.or(kv_port);
            }
            entry.ready |= ready;
        }
    }
    let lookup = |found: bool| {
        if count == 0 {
            PortLookup::NoSlices
        } else if found {
            PortLookup::Found
        } else {
            PortLookup::Missing
        }
    };
    let mut ready = Vec::new();
    let mut not_ready = 0;
    for (key, s) in seen {
        match (s.ready, s.http_port) {
            (true, Some(http_port)) => ready.push(Endpoint {
                key,
                address: s.address,
                http_port,
                kv_port: s.kv_port,
            }),
            (false, _) => not_ready += 1,
            (true, None) => {}
        }
    }
    Resolution {
        slices: count,
        ready,
        not_ready,
        http_port: lookup(http_found),
        kv_port: kv.map(|_| lookup(kv_found)),
        same_port,
        ports: port_names.into_iter().collect(),
    }
}

fn describe_port(p: &EndpointPort) -> String {
    match (p.name.as_deref().filter(|n| !n.is_empty()), p.port) {
        (Some(n), Some(q)) => format!("{n}:{q}"),
        (Some(n), None) => n.to_owned(),
        (None, Some(q)) => q.to_string(),
        (None, None) => "all ports".to_owned(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::discovery::v1::{Endpoint as SliceEndpoint, EndpointConditions};
    use kube::core::ObjectMeta;

    /// A slice of `service` with `ports` (name, number) and endpoints
    /// (address, ready).
    pub(crate) fn mk_slice(
        name: &str,
        service: &str,
        ports: &[(&str, i32)],
        endpoints: &[(&str, Option<bool>)],
    ) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
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
                        ..Default::default()
                    })
                    .collect(),
            ),
            endpoints: endpoints
                .iter()
                .map(|(a, ready)| SliceEndpoint {
                    addresses: vec![(*a).to_owned()],
                    conditions: Some(EndpointConditions {
                        ready: *ready,
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn name(s: &str) -> PortRef {
        PortRef::Name(s.into())
    }

    fn addresses(r: &Resolution) -> Vec<&str> {
        r.ready.iter().map(|e| e.address.as_str()).collect()
    }

    #[test]
    fn ready_endpoints_are_deduplicated_across_slices() {
        let a = mk_slice(
            "a",
            "svc",
            &[("http", 8000)],
            &[("10.0.0.1", Some(true)), ("10.0.0.2", None)],
        );
        let b = mk_slice(
            "b",
            "svc",
            &[("http", 8000)],
            &[("10.0.0.2", Some(true)), ("10.0.0.3", Some(false))],
        );
        let other = mk_slice("c", "other", &[("http", 8000)], &[("10.9.9.9", None)]);
        let r = resolve("svc", &name("http"), None, [&a, &b, &other]);
        assert_eq!(r.slices, 2);
        assert_eq!(addresses(&r), ["10.0.0.1", "10.0.0.2"]);
        assert_eq!(r.not_ready, 1);
        assert_eq!(r.http_port, PortLookup::Found);
        assert_eq!(r.kv_port, None);
    }

    #[test]
    fn an_endpoint_ready_in_any_listing_is_ready() {
        let a = mk_slice("a", "svc", &[("http", 8000)], &[("10.0.0.1", Some(false))]);
        let b = mk_slice("b", "svc", &[("http", 8000)], &[("10.0.0.1", Some(true))]);
        let r = resolve("svc", &name("http"), None, [&a, &b]);
        assert_eq!(addresses(&r), ["10.0.0.1"]);
        assert_eq!(r.not_ready, 0);
    }

    #[test]
    fn target_refs_deduplicate_dual_stack_listings() {
        let mut v4 = mk_slice("v4", "svc", &[("http", 8000)], &[("10.0.0.1", None)]);
        let mut v6 = mk_slice("v6", "svc", &[("http", 8000)], &[("fd00::1", None)]);
        for s in [&mut v4, &mut v6] {
            s.endpoints[0].target_ref = Some(ObjectReference {
                kind: Some("Pod".into()),
                namespace: Some("ns".into()),
                name: Some("engine-0".into()),
                ..Default::default()
            });
        }
        let r = resolve("svc", &name("http"), None, [&v4, &v6]);
        assert_eq!(r.ready.len(), 1);
        assert_eq!(r.ready[0].key, "Pod/ns/engine-0");
    }

    #[test]
    fn ports_resolve_by_name_or_number() {
        let s = mk_slice(
            "a",
            "svc",
            &[("http", 8000), ("kv-pub", 5557)],
            &[("10.0.0.1", None)],
        );
        let r = resolve("svc", &PortRef::Number(8000), Some(&name("kv-pub")), [&s]);
        assert_eq!(r.http_port, PortLookup::Found);
        assert_eq!(r.kv_port, Some(PortLookup::Found));
        assert_eq!(r.ready[0].http_port, 8000);
        assert_eq!(r.ready[0].kv_port, Some(5557));
        assert_eq!(r.ready_without_kv_port().count(), 0);

        let r = resolve("svc", &name("grpc"), Some(&PortRef::Number(5558)), [&s]);
        assert_eq!(r.http_port, PortLookup::Missing);
        assert_eq!(r.kv_port, Some(PortLookup::Missing));
        assert_eq!(r.ports, ["http:8000", "kv-pub:5557"]);
        assert!(
            r.ready.is_empty(),
            "no endpoint is routable without its port"
        );

        let r = resolve("svc", &name("http"), None, std::iter::empty());
        assert_eq!(r.http_port, PortLookup::NoSlices);
        assert_eq!(r.slices, 0);
    }

    #[test]
    fn digit_strings_are_numbers() {
        assert_eq!(
            PortRef::from_int_or_string(&IntOrString::String("8000".into())),
            PortRef::Number(8000)
        );
        assert_eq!(
            PortRef::from_int_or_string(&IntOrString::String("http".into())),
            name("http")
        );
        assert_eq!(
            PortRef::from_int_or_string(&IntOrString::Int(5557)),
            PortRef::Number(5557)
        );
    }

    #[test]
    fn a_port_without_number_means_all_ports() {
        let mut s = mk_slice("a", "svc", &[], &[("10.0.0.1", None)]);
        s.ports = Some(vec![EndpointPort::default()]);
        let r = resolve("svc", &PortRef::Number(8000), None, [&s]);
        assert_eq!(r.http_port, PortLookup::Found);
        assert_eq!(r.ready[0].http_port, 8000);
        // A name cannot match a port that has no name.
        let r = resolve("svc", &name("http"), None, [&s]);
        assert_eq!(r.http_port, PortLookup::Missing);
    }

    #[test]
    fn kv_port_missing_on_some_endpoints() {
        let with = mk_slice(
            "a",
            "svc",
            &[("http", 8000), ("kv-pub", 5557)],
            &[("10.0.0.1", None)],
        );
        let without = mk_slice("b", "svc", &[("http", 8000)], &[("10.0.0.2", None)]);
        let r = resolve(
            "svc",
            &name("http"),
            Some(&name("kv-pub")),
            [&with, &without],
        );
        assert_eq!(r.kv_port, Some(PortLookup::Found));
        let missing: Vec<_> = r.ready_without_kv_port().map(|e| &e.address).collect();
        assert_eq!(missing, ["10.0.0.2"]);
    }

    #[test]
    fn same_port_for_both_is_noticed() {
        let s = mk_slice("a", "svc", &[("http", 8000)], &[("10.0.0.1", None)]);
        let r = resolve("svc", &name("http"), Some(&PortRef::Number(8000)), [&s]);
        assert_eq!(r.same_port, Some(8000));
    }

    #[test]
    fn ipv6_authorities_use_brackets() {
        assert_eq!(authority("fd00::1", 80), "[fd00::1]:80");
        assert_eq!(authority("10.0.0.1", 80), "10.0.0.1:80");
        assert_eq!(authority("engine-0.svc", 80), "engine-0.svc:80");
    }
}
