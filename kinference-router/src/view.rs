//! The routing view: what a request is resolved against.
//!
//! Rebuilt (never mutated) whenever the catalog publishes a snapshot or an
//! endpoint's discovered models change; requests read the current
//! `Arc<View>` without waiting on anything.
//!
//! A name a client sends resolves to *targets*: a worker set and the model
//! name its engines serve (an alias is rewritten to it). Names come from the
//! worker sets' `spec.models` (names and aliases) and from what the engines
//! list in `/v1/models`. A worker set whose profile is unknown is left out.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::Serialize;

use crate::catalog::{Snapshot, WorkerSetRoute};
use crate::endpoint::{Endpoint, EndpointKey, Registry};
use crate::runtime::WsRuntime;

/// One worker set, with its live endpoints.
#[derive(Debug)]
pub struct WorkerSetView {
    /// The catalog's view of it.
    pub route: WorkerSetRoute,
    /// Its endpoints' states, in the catalog's order.
    pub endpoints: Vec<Arc<Endpoint>>,
    /// Its policy, tokenizer and prefix record.
    pub runtime: Arc<WsRuntime>,
    /// Its name as a header value (`x-kinference-worker-set`).
    pub name_header: Option<http::HeaderValue>,
    /// The models its engines list as LoRA adapters (a card with a
    /// parent), by name.
    adapters: HashMap<String, Arc<str>>,
}

impl WorkerSetView {
    /// `model` as a LoRA adapter name, when the engines list it as one.
    pub fn adapter(&self, model: &str) -> Option<Arc<str>> {
        self.adapters.get(model).cloned()
    }

    /// The endpoints that may take a request for `model` at `now`: not
    /// ejected, not in `excluded`, and serving `model` (or not yet known to
    /// serve anything).
    pub fn serving(
        &self,
        model: &str,
        now: tokio::time::Instant,
        excluded: &[crate::endpoint::EndpointId],
    ) -> Vec<Arc<Endpoint>> {
        self.candidates(model, Some(now), excluded)
    }

    /// As [`WorkerSetView::serving`], ejected endpoints included when `now`
    /// is `None` (panic mode: when every endpoint is ejected, try them
    /// anyway rather than fail).
    pub fn candidates(
        &self,
        model: &str,
        now: Option<tokio::time::Instant>,
        excluded: &[crate::endpoint::EndpointId],
    ) -> Vec<Arc<Endpoint>> {
        self.endpoints
            .iter()
            .filter(|e| now.is_none_or(|n| e.healthy(n)) && !excluded.contains(&e.id))
            .filter(|e| {
                let models = e.models();
                models.is_empty() || models.iter().any(|m| m.id == model)
            })
            .cloned()
            .collect()
    }
}

/// Where a requested name can go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// Index into [`View::worker_sets`].
    pub worker_set: usize,
    /// The model name to send to the engines.
    pub model: String,
}

/// A model card for the router's own `/v1/models`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Card {
    /// The name clients send.
    pub id: String,
    /// The model it maps to on the engines.
    pub root: String,
    /// The context length the engines report.
    pub max_model_len: Option<u64>,
    /// Worker sets serving it.
    pub worker_sets: Vec<String>,
}

/// The routing view.
#[derive(Debug, Default)]
pub struct View {
    /// The pool's routable worker sets.
    pub worker_sets: Vec<WorkerSetView>,
    names: HashMap<String, Vec<Target>>,
    /// Cards for `/v1/models`, sorted by id.
    pub cards: Vec<Card>,
    /// The discovered-models version it was built from
    /// ([`crate::state::Runtime::models_version`]).
    pub models_version: u64,
}

impl View {
    /// Builds the view of `snapshot` with the endpoint states in `registry`
    /// and each worker set's runtime from `runtime`.
    pub fn build(
        snapshot: &Snapshot,
        registry: &Registry,
        runtime: &dyn Fn(&WorkerSetRoute) -> Arc<WsRuntime>,
    ) -> Self {
        let mut worker_sets = Vec::new();
        for route in &snapshot.worker_sets {
            if !route.profile_known() {
                continue;
            }
            let endpoints: Vec<Arc<Endpoint>> = route
                .endpoints
                .iter()
                .filter_map(|e| {
                    registry
                        .get(&EndpointKey {
                            address: e.address.clone(),
                            http_port: e.http_port,
                        })
                        .cloned()
                })
                .collect();
            let adapters = endpoints
                .iter()
                .flat_map(|e| e.models())
                .filter(|m| m.parent.is_some())
                .map(|m| {
                    let name: Arc<str> = Arc::from(m.id.as_str());
                    (m.id, name)
                })
                .collect();
            worker_sets.push(WorkerSetView {
                name_header: http::HeaderValue::from_str(&route.name).ok(),
                route: route.clone(),
                endpoints,
                runtime: runtime(route),
                adapters,
            });
        }

        // name -> (target, context length)
        let mut names: BTreeMap<String, Vec<(Target, Option<u64>)>> = BTreeMap::new();
        let mut add = |name: &str, t: Target, len: Option<u64>| {
            let v = names.entry(name.to_owned()).or_default();
            if !v.iter().any(|(x, _)| *x == t) {
                v.push((t, len));
            }
        };
        for (i, ws) in worker_sets.iter().enumerate() {
            let discovered: Vec<_> = ws.endpoints.iter().flat_map(|e| e.models()).collect();
            let len_of = |model: &str| {
                discovered
                    .iter()
                    .filter(|m| m.id == model)
                    .find_map(|m| m.max_model_len)
            };
            for m in &ws.route.models {
                let t = Target {
                    worker_set: i,
                    model: m.name.clone(),
                };
                add(&m.name, t.clone(), len_of(&m.name));
                for a in &m.aliases {
                    add(a, t.clone(), len_of(&m.name));
                }
            }
            for m in &discovered {
                let t = Target {
                    worker_set: i,
                    model: m.id.clone(),
                };
                add(&m.id, t, m.max_model_len);
            }
        }
        let cards = names
            .iter()
            .map(|(id, ts)| Card {
                id: id.clone(),
                root: ts[0].0.model.clone(),
                max_model_len: ts.iter().find_map(|(_, l)| *l),
                worker_sets: ts
                    .iter()
                    .map(|(t, _)| worker_sets[t.worker_set].route.name.clone())
                    .collect(),
            })
            .collect();
        let names = names
            .into_iter()
            .map(|(k, v)| (k, v.into_iter().map(|(t, _)| t).collect()))
            .collect();
        Self {
            worker_sets,
            names,
            cards,
            models_version: 0,
        }
    }

    /// The endpoint at `authority` (`address:port`), whichever worker sets
    /// list it.
    pub fn endpoint(&self, authority: &str) -> Option<&Arc<Endpoint>> {
        self.worker_sets
            .iter()
            .flat_map(|ws| &ws.endpoints)
            .find(|e| e.authority == authority)
    }

    /// The targets of a requested model name or alias.
    pub fn resolve(&self, name: &str) -> Option<&[Target]> {
        self.names.get(name).map(Vec::as_slice)
    }

    /// The model a request that names none is for: the pool's one base
    /// model, as a vLLM or SGLang engine serves its own to such a request
    /// (aliases of it do not count as more; adapters are not base models).
    ///
    /// # Errors
    /// The names of the pool's base models when it serves none or several.
    pub fn only_model(&self) -> Result<&str, Vec<&str>> {
        let adapter = |m: &str| {
            self.worker_sets
                .iter()
                .any(|ws| ws.adapters.contains_key(m))
        };
        let mut models: Vec<&str> = self
            .names
            .values()
            .flatten()
            .map(|t| t.model.as_str())
            .filter(|m| !adapter(m))
            .collect();
        models.sort_unstable();
        models.dedup();
        match models[..] {
            [one] => Ok(one),
            _ => Err(models),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::DiscoveredModel;
    use kinference_api::endpoints::ReadyEndpoint;
    use kinference_api::v1alpha1::ModelSpec;
    use tokio_util::sync::CancellationToken;

    fn route(name: &str, models: Vec<ModelSpec>, addrs: &[&str], profile: &str) -> WorkerSetRoute {
        WorkerSetRoute {
            name: name.into(),
            kv_block_size: 16,
            profile_name: profile.into(),
            profile: None,
            models,
            kv_events: true,
            endpoints: addrs
                .iter()
                .map(|a| ReadyEndpoint {
                    address: (*a).into(),
                    http_port: 8000,
                    kv_port: Some(5557),
                    replay_port: None,
                    target: None,
                })
                .collect(),
        }
    }

    #[test]
    fn names_aliases_and_discovered_models_resolve() {
        let snap = Snapshot {
            synced: true,
            pool_found: true,
            worker_sets: vec![
                route(
                    "qwen",
                    vec![ModelSpec {
                        name: "Qwen/Qwen3-8B".into(),
                        aliases: vec!["qwen".into(), "q".into()],
                    }],
                    &["10.0.0.1", "10.0.0.2"],
                    "default",
                ),
                route("gemma", vec![], &["10.0.0.3"], "default"),
                route("broken", vec![], &["10.0.0.4"], "no-such-profile"),
            ],
            problems: vec![],
        };
        let mut reg = Registry::default();
        let stop = CancellationToken::new();
        reg.sync(
            snap.endpoints().map(|(_, e)| EndpointKey {
                address: e.address.clone(),
                http_port: e.http_port,
            }),
            &stop,
        );
        for e in reg.all() {
            if e.key.address == "10.0.0.3" {
                e.set_models(Ok(vec![
                    DiscoveredModel {
                        id: "google/gemma".into(),
                        max_model_len: Some(8192),
                        parent: None,
                        root: None,
                        owned_by: None,
                    },
                    DiscoveredModel {
                        id: "sql".into(),
                        max_model_len: Some(8192),
                        parent: Some("google/gemma".into()),
                        root: Some("/adapters/sql".into()),
                        owned_by: None,
                    },
                ]));
            }
        }
        let rt = Arc::new(WsRuntime::new(
            kinference_scoring::LatencyParams::default(),
            kinference_api::v1alpha1::TokenizationMode::Engine,
            kinference_scoring::PolicyName::Kinference,
            std::time::Duration::from_secs(30),
        ));
        let view = View::build(&snap, &reg, &|_| rt.clone());
        assert_eq!(
            view.worker_sets.len(),
            2,
            "the unknown-profile set is left out"
        );
        assert_eq!(view.worker_sets[0].endpoints.len(), 2);

        let q = view.resolve("qwen").unwrap();
        assert_eq!(
            q,
            [Target {
                worker_set: 0,
                model: "Qwen/Qwen3-8B".into()
            }]
        );
        assert_eq!(view.resolve("q").unwrap()[0].model, "Qwen/Qwen3-8B");
        assert_eq!(view.resolve("google/gemma").unwrap()[0].worker_set, 1);
        assert!(view.resolve("nope").is_none());

        // A card with a parent is a LoRA adapter of that worker set.
        assert_eq!(view.resolve("sql").unwrap()[0].worker_set, 1);
        assert_eq!(view.worker_sets[1].adapter("sql").as_deref(), Some("sql"));
        assert_eq!(view.worker_sets[1].adapter("google/gemma"), None);
        assert_eq!(view.worker_sets[0].adapter("sql"), None);

        let ids: Vec<&str> = view.cards.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["Qwen/Qwen3-8B", "google/gemma", "q", "qwen", "sql"]);
        assert_eq!(view.cards[1].max_model_len, Some(8192));
        assert_eq!(view.cards[3].root, "Qwen/Qwen3-8B");

        // A request without a model: two base models (the adapter is not
        // one), so none is the default; one worker set alone, its model
        // (its aliases are not more models).
        assert_eq!(
            view.only_model(),
            Err(vec!["Qwen/Qwen3-8B", "google/gemma"])
        );
        let one = Snapshot {
            worker_sets: vec![snap.worker_sets[0].clone()],
            ..snap
        };
        let view = View::build(&one, &reg, &|_| rt.clone());
        assert_eq!(view.only_model(), Ok("Qwen/Qwen3-8B"));
        let none = Snapshot {
            worker_sets: vec![],
            ..one
        };
        assert_eq!(
            View::build(&none, &reg, &|_| rt.clone()).only_model(),
            Err(vec![])
        );
    }
}
