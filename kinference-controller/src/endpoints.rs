//! A worker set's endpoints, as its Service's EndpointSlices describe them.
//!
//! The reading itself is kinference-api's ([`kinference_api::endpoints`]),
//! shared with the router so that both agree on which endpoints are ready
//! and on which ports; this module adds what the controller judges from it.
//! Pure: slices in, [`Resolution`] out.
//!
//! - A port *does not resolve* when slices exist and none of them carries it
//!   (by name, or by number; see kinference-api for the rules): that is the
//!   `InvalidPort` rejection, and exactly when the router cannot use it.
//! - Endpoints in slices that lack the KV port while other slices have it
//!   get no KV events: the `KvPortMissing` diagnosis.
//! - A slice that resolves both ports to one number is a spec error too.
//!
//! Cost: O(slices × (ports + endpoints)), plus sorting the ready endpoints.

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kinference_api::InferenceWorkerSetSpec;
pub use kinference_api::endpoints::{
    Endpoints, PortError, ReadyEndpoint, SERVICE_NAME_LABEL, belongs_to,
};

/// How a port reference fared against the slices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortLookup {
    /// No slice exists for the Service: nothing can be judged yet.
    NoSlices,
    /// At least one slice carries the port.
    Found,
    /// Slices exist and none carries the port; the first slice's complaint.
    Missing(PortError),
}

impl PortLookup {
    fn from_errors(slices: usize, errors: &[PortError]) -> Self {
        match errors.first() {
            _ if slices == 0 => PortLookup::NoSlices,
            Some(e) if errors.len() == slices => PortLookup::Missing(e.clone()),
            _ => PortLookup::Found,
        }
    }

    /// Whether slices exist and none carries the port.
    pub fn is_missing(&self) -> bool {
        matches!(self, PortLookup::Missing(_))
    }
}

/// What the slices say about one worker set's Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolution {
    /// The endpoints as kinference-api reads them (ready ones sorted).
    pub endpoints: Endpoints,
    /// The serving port (`serviceRef.port`).
    pub http_port: PortLookup,
    /// The KV port (`kvEvents.port`); `None` when `kvEvents` is unset.
    pub kv_port: Option<PortLookup>,
    /// Some ready endpoint has both ports on one number.
    pub same_port: Option<u16>,
}

impl Resolution {
    /// Ready, routable endpoints.
    pub fn ready(&self) -> &[ReadyEndpoint] {
        &self.endpoints.ready
    }

    /// Ready endpoints without the KV port although `kvEvents` is set.
    pub fn ready_without_kv_port(&self) -> impl Iterator<Item = &ReadyEndpoint> {
        let kv_set = self.kv_port.is_some();
        self.endpoints
            .ready
            .iter()
            .filter(move |e| kv_set && e.kv_port.is_none())
    }
}

/// Resolves a worker set's endpoints from `slices` (any slices: those of
/// other Services are ignored).
pub fn resolve<'a>(
    spec: &InferenceWorkerSetSpec,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
) -> Resolution {
    let service = &spec.service_ref.name;
    let kv = spec.kv_events.as_ref().map(|k| &k.port);
    let slices: Vec<&EndpointSlice> = slices
        .into_iter()
        .filter(|s| belongs_to(s, service))
        .collect();
    let replay = spec.kv_events.as_ref().and_then(|k| k.replay_port.as_ref());
    let endpoints =
        kinference_api::endpoints::read(slices.iter().copied(), &spec.service_ref.port, kv, replay);
    let http_port = PortLookup::from_errors(endpoints.slices, &endpoints.http_port_errors);
    // Judged on every slice (the reader skips the KV port of a slice whose
    // HTTP port does not resolve).
    let kv_port = kv.map(|k| {
        let errors: Vec<PortError> = slices
            .iter()
            .filter_map(|s| {
                kinference_api::endpoints::resolve_port(k, s.ports.as_deref().unwrap_or_default())
                    .err()
            })
            .collect();
        PortLookup::from_errors(slices.len(), &errors)
    });
    let same_port = endpoints
        .ready
        .iter()
        .find(|e| e.kv_port == Some(e.http_port))
        .map(|e| e.http_port);
    Resolution {
        endpoints,
        http_port,
        kv_port,
        same_port,
    }
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

/// `host:port`, with an IPv6 host in brackets.
pub fn authority(host: &str, port: u16) -> String {
    match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(_)) => format!("[{host}]:{port}"),
        _ => format!("{host}:{port}"),
    }
}

/// `host:port` of an endpoint's OpenAI API.
pub fn http_authority(e: &ReadyEndpoint) -> String {
    authority(&e.address, e.http_port)
}

/// `host:port` of an endpoint's KV-event publisher, if known.
pub fn kv_authority(e: &ReadyEndpoint) -> Option<String> {
    e.kv_port.map(|p| authority(&e.address, p))
}

/// A port reference for messages: a name quoted, a number bare.
pub fn describe_port(port: &IntOrString) -> String {
    match port {
        IntOrString::Int(n) => n.to_string(),
        IntOrString::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
            s.clone()
        }
        IntOrString::String(s) => format!("{s:?}"),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::tests::mk_spec;

    pub(crate) use kinference_api::test_util::mk_slice;

    fn addresses(r: &Resolution) -> Vec<&str> {
        r.ready().iter().map(|e| e.address.as_str()).collect()
    }

    #[test]
    fn only_the_services_slices_count() {
        let spec = mk_spec("svc", "http", None, &[]);
        let a = mk_slice("a", "svc", &[("http", 8000)], &[("10.0.0.1", Some(true))]);
        let b = mk_slice(
            "b",
            "svc",
            &[("http", 8000)],
            &[("10.0.0.1", None), ("10.0.0.3", Some(false))],
        );
        let other = mk_slice("c", "other", &[("http", 8000)], &[("10.9.9.9", None)]);
        let r = resolve(&spec, [&a, &b, &other]);
        assert_eq!(r.endpoints.slices, 2);
        assert_eq!(addresses(&r), ["10.0.0.1"]);
        assert_eq!(r.endpoints.not_ready, 1);
        assert_eq!(r.http_port, PortLookup::Found);
        assert_eq!(r.kv_port, None);
    }

    #[test]
    fn a_port_missing_from_every_slice_does_not_resolve() {
        let s = mk_slice(
            "a",
            "svc",
            &[("http", 8000), ("kv-pub", 5557)],
            &[("10.0.0.1", None)],
        );
        let ok = resolve(&mk_spec("svc", "8000", Some("kv-pub"), &[]), [&s]);
        assert_eq!(
            (ok.http_port.clone(), ok.kv_port.clone()),
            (PortLookup::Found, Some(PortLookup::Found))
        );
        assert_eq!(ok.ready()[0].kv_port, Some(5557));

        let bad = resolve(&mk_spec("svc", "grpc", Some("5558"), &[]), [&s]);
        assert!(bad.http_port.is_missing());
        assert!(bad.kv_port.as_ref().is_some_and(PortLookup::is_missing));
        assert!(
            bad.ready().is_empty(),
            "no endpoint is routable without its port"
        );
        let PortLookup::Missing(e) = &bad.http_port else {
            unreachable!("checked above")
        };
        assert_eq!(
            e.to_string(),
            "the Service has no port named \"grpc\" (its ports: http=8000, kv-pub=5557)"
        );

        let unjudged = resolve(&mk_spec("svc", "grpc", None, &[]), std::iter::empty());
        assert_eq!(unjudged.http_port, PortLookup::NoSlices);
    }

    #[test]
    fn found_in_one_slice_is_found() {
        let with = mk_slice(
            "a",
            "svc",
            &[("http", 8000), ("kv-pub", 5557)],
            &[("10.0.0.1", None)],
        );
        let without = mk_slice("b", "svc", &[("http", 8000)], &[("10.0.0.2", None)]);
        let r = resolve(
            &mk_spec("svc", "http", Some("kv-pub"), &[]),
            [&with, &without],
        );
        assert_eq!(r.kv_port, Some(PortLookup::Found));
        let missing: Vec<_> = r.ready_without_kv_port().map(|e| &e.address).collect();
        assert_eq!(missing, ["10.0.0.2"]);
    }

    #[test]
    fn same_port_for_both_is_noticed() {
        let s = mk_slice("a", "svc", &[("http", 8000)], &[("10.0.0.1", None)]);
        let r = resolve(&mk_spec("svc", "http", Some("8000"), &[]), [&s]);
        assert_eq!(r.same_port, Some(8000));
    }

    #[test]
    fn authorities_and_port_words() {
        assert_eq!(authority("fd00::1", 80), "[fd00::1]:80");
        assert_eq!(authority("10.0.0.1", 80), "10.0.0.1:80");
        assert_eq!(authority("engine-0.svc", 80), "engine-0.svc:80");
        assert_eq!(
            describe_port(&IntOrString::String("http".into())),
            "\"http\""
        );
        assert_eq!(describe_port(&IntOrString::String("8000".into())), "8000");
        assert_eq!(describe_port(&IntOrString::Int(5557)), "5557");
    }
}
