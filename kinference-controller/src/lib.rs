//! The kinference controller (crate docs are written below, once the
//! modules exist).

pub mod diagnose;
pub mod endpoints;
pub mod probe;
pub mod status;

#[cfg(test)]
pub(crate) mod tests {
    //! Builders for unit tests.

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use k8s_openapi::jiff::Timestamp;
    use kinference_api::v1alpha1::{KvEventsRef, ModelSpec, ServiceRef, WorkerSetRef};
    use kinference_api::{
        InferencePool, InferencePoolSpec, InferenceWorkerSet, InferenceWorkerSetSpec,
    };
    use kube::core::ObjectMeta;

    /// A time `secs` seconds after the epoch.
    pub(crate) fn at(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).expect("a valid time"))
    }

    fn port(p: &str) -> IntOrString {
        match p.parse::<i32>() {
            Ok(n) => IntOrString::Int(n),
            Err(_) => IntOrString::String(p.to_owned()),
        }
    }

    /// A spec with profile `default`, kvBlockSize 16, the Service and ports
    /// given, and `models` as (name, aliases).
    pub(crate) fn mk_spec(
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
            kv_events: kv.map(|k| KvEventsRef { port: port(k) }),
            models: models
                .iter()
                .map(|(name, aliases)| ModelSpec {
                    name: (*name).into(),
                    aliases: aliases.iter().map(|a| (*a).to_owned()).collect(),
                })
                .collect(),
        }
    }

    /// A worker set in namespace `ns`, created at `created` (seconds), generation 1.
    pub(crate) fn mk_ws(
        name: &str,
        created: i64,
        spec: InferenceWorkerSetSpec,
    ) -> InferenceWorkerSet {
        let mut ws = InferenceWorkerSet::new(name, spec);
        ws.metadata = ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            generation: Some(1),
            creation_timestamp: Some(at(created)),
            ..Default::default()
        };
        ws
    }

    /// A pool in namespace `ns` naming `sets`, generation 1.
    pub(crate) fn mk_pool(name: &str, sets: &[&str]) -> InferencePool {
        let mut pool = InferencePool::new(
            name,
            InferencePoolSpec {
                worker_sets: sets
                    .iter()
                    .map(|s| WorkerSetRef { name: (*s).into() })
                    .collect(),
            },
        );
        pool.metadata.namespace = Some("ns".into());
        pool.metadata.generation = Some(1);
        pool
    }
}
