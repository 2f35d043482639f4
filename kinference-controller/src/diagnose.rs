//! Diagnoses: findings about a worker set that a person should fix but that
//! do not stop routing.
//!
//! Pure: [`diagnose`] takes the spec, the endpoint [`Resolution`] and the
//! latest [`ProbeResult`] and returns at most one [`Finding`] per
//! [`DiagnosisReason`], in the order of [`DiagnosisReason::ALL`]. Each message
//! says what was seen and what to change, and depends only on the inputs
//! (sorted lists, no times), so an unchanged situation gives the same text
//! and causes no status write.
//!
//! | reason | from | when |
//! |---|---|---|
//! | `KvPortMissing` | slices | `kvEvents.port` resolves in some slices, but some ready endpoints sit in slices without it |
//! | `KvPortClosed` | KV window | a publisher refuses connections, or accepts TCP but no ZeroMQ handshake |
//! | `NoKvEvents` | KV window | no events in a window while the engine served requests and computed [`VERDICT_BLOCKS`] blocks' worth of new tokens ([`KvWindow::saw_traffic`](crate::probe::KvWindow::saw_traffic)) |
//! | `BlockSizeMismatch` | KV window | events carry blocks of a width other than `kvBlockSize` |
//! | `ModelMismatch` | `/v1/models` | endpoints serve different (base) models |
//! | `ModelNotServed` | `/v1/models` | a `spec.models[].name` (and so its aliases) is served by no endpoint |
//! | `ModelsUnreachable` | `/v1/models` | some ready endpoints gave no model list |
//!
//! `TokenizerMismatch` needs the router's tokenizer and is not made here.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use kinference_api::{DiagnosisReason, InferenceWorkerSetSpec};

use crate::endpoints::{PortLookup, Resolution, describe_port};
use crate::probe::{KvObservation, KvProbe, ProbeResult, VERDICT_BLOCKS};

/// One diagnosis before it gets its `since` time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The code.
    pub reason: DiagnosisReason,
    /// What was seen and what to change.
    pub message: String,
}

/// How many items a message lists before it says "and N more".
const LIST_MAX: usize = 5;

/// Lists `items` for a message, at most [`LIST_MAX`] of them.
fn list<I: IntoIterator<Item = S>, S: AsRef<str>>(items: I) -> String {
    let items: Vec<S> = items.into_iter().collect();
    let mut out = String::new();
    for (i, s) in items.iter().take(LIST_MAX).enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(s.as_ref());
    }
    if items.len() > LIST_MAX {
        let _ = write!(out, " and {} more", items.len() - LIST_MAX);
    }
    out
}

/// The diagnoses of one worker set.
pub fn diagnose(
    spec: &InferenceWorkerSetSpec,
    endpoints: &Resolution,
    probe: Option<&ProbeResult>,
) -> Vec<Finding> {
    let mut out = Vec::new();
    kv_port_missing(spec, endpoints, &mut out);
    if let Some(p) = probe {
        if let KvProbe::Observed(obs) = &p.kv {
            kv_findings(spec, obs, &mut out);
        }
        model_findings(spec, p, &mut out);
    }
    out.sort_by_key(|f| DiagnosisReason::ALL.iter().position(|r| *r == f.reason));
    out
}

fn kv_port_missing(spec: &InferenceWorkerSetSpec, endpoints: &Resolution, out: &mut Vec<Finding>) {
    let Some(kv) = &spec.kv_events else {
        return;
    };
    if endpoints.kv_port != Some(PortLookup::Found) {
        // Missing everywhere is a rejection (InvalidPort), not a diagnosis.
        return;
    }
    let missing: Vec<&str> = endpoints
        .ready_without_kv_port()
        .map(|e| e.address.as_str())
        .collect();
    if missing.is_empty() {
        return;
    }
    let port = describe_port(&kv.port);
    out.push(Finding {
        reason: DiagnosisReason::KvPortMissing,
        message: format!(
            "{} of {} ready endpoints ({}) expose no port {port} in their EndpointSlices, so the router gets no KV events from them and routes to them on load alone: give their pods the port {port} (kvEvents.port)",
            missing.len(),
            endpoints.ready().len(),
            list(&missing),
        ),
    });
}

fn kv_findings(spec: &InferenceWorkerSetSpec, obs: &KvObservation, out: &mut Vec<Finding>) {
    match obs {
        KvObservation::Closed { endpoint, error } => {
            let port = spec
                .kv_events
                .as_ref()
                .map(|k| describe_port(&k.port))
                .unwrap_or_default();
            out.push(Finding {
                reason: DiagnosisReason::KvPortClosed,
                message: format!(
                    "cannot subscribe to KV events on {endpoint} ({error}): start the engines with a ZeroMQ KV-event publisher on the port kvEvents.port {port} names (vLLM: --kv-events-config with enable_kv_cache_events true, publisher \"zmq\" and endpoint \"tcp://*:PORT\"), or unset kvEvents"
                ),
            });
        }
        KvObservation::Subscribed(w) => {
            let from = list(&w.publishers);
            if w.batches == 0 && w.saw_traffic(spec.kv_block_size) {
                out.push(Finding {
                    reason: DiagnosisReason::NoKvEvents,
                    message: format!(
                        "subscribed to {from} for {} and received no KV events while the engine served requests (it computed at least {} new tokens, {VERDICT_BLOCKS} blocks' worth): enable prefix caching and KV events on the engines (vLLM: --enable-prefix-caching and --kv-events-config with enable_kv_cache_events true), or unset kvEvents",
                        w.window_text(),
                        w.verdict_tokens(spec.kv_block_size),
                    ),
                });
            }
            let other: Vec<u32> = w
                .block_sizes
                .iter()
                .copied()
                .filter(|b| *b != spec.kv_block_size)
                .collect();
            if !other.is_empty() {
                let seen = list(w.block_sizes.iter().map(u32::to_string));
                let advice = if w.block_sizes.len() == 1 {
                    format!("set kvBlockSize: {}", other[0])
                } else {
                    "the engines publish several block widths (several KV-cache groups); set kvBlockSize to the width of the group the router should follow".to_owned()
                };
                out.push(Finding {
                    reason: DiagnosisReason::BlockSizeMismatch,
                    message: format!(
                        "KV events from {from} carry {seen}-token blocks but kvBlockSize is {}: {advice} (kvBlockSize is the width of the events, which can differ from the engine's --block-size)",
                        spec.kv_block_size
                    ),
                });
            }
        }
    }
}

fn model_findings(spec: &InferenceWorkerSetSpec, probe: &ProbeResult, out: &mut Vec<Finding>) {
    let answered: Vec<_> = probe
        .models
        .iter()
        .filter_map(|m| m.outcome.as_ref().ok().map(|cards| (&m.endpoint, cards)))
        .collect();
    let failed: Vec<String> = probe
        .models
        .iter()
        .filter_map(|m| {
            m.outcome
                .as_ref()
                .err()
                .map(|e| format!("{}: {e}", m.endpoint))
        })
        .collect();

    if !failed.is_empty() {
        let how_many = if answered.is_empty() {
            format!("none of the {} ready endpoints", failed.len())
        } else {
            format!("{} of {} ready endpoints", failed.len(), probe.models.len())
        };
        out.push(Finding {
            reason: DiagnosisReason::ModelsUnreachable,
            message: format!(
                "{how_many} answered GET /v1/models ({}): check that serviceRef.port {} is the engines' OpenAI API port and that they are up",
                list(&failed),
                describe_port(&spec.service_ref.port)
            ),
        });
    }
    if answered.is_empty() {
        return;
    }

    // Endpoints grouped by the base models they serve (LoRA adapters come
    // and go at run time and are left out of the comparison).
    let mut groups: BTreeMap<BTreeSet<&str>, Vec<&str>> = BTreeMap::new();
    for (endpoint, cards) in &answered {
        let base: BTreeSet<&str> = cards
            .iter()
            .filter(|c| c.parent.is_none())
            .map(|c| c.id.as_str())
            .collect();
        groups.entry(base).or_default().push(endpoint.as_str());
    }
    if groups.len() > 1 {
        let described: Vec<String> = groups
            .iter()
            .map(|(models, eps)| {
                let models = if models.is_empty() {
                    "no base model".to_owned()
                } else {
                    list(models.iter())
                };
                format!("{models} on {}", list(eps.iter()))
            })
            .collect();
        out.push(Finding {
            reason: DiagnosisReason::ModelMismatch,
            message: format!(
                "the endpoints serve different models: {}: a worker set is one model behind one Service; give all its engines the same --served-model-name, or split them into worker sets",
                described.join("; ")
            ),
        });
    }

    let served: BTreeSet<&str> = answered
        .iter()
        .flat_map(|(_, cards)| cards.iter().map(|c| c.id.as_str()))
        .collect();
    let unserved: Vec<String> = spec
        .models
        .iter()
        .filter(|m| !served.contains(m.name.as_str()))
        .map(|m| {
            if m.aliases.is_empty() {
                format!("{:?}", m.name)
            } else {
                format!("{:?} (aliases {})", m.name, list(&m.aliases))
            }
        })
        .collect();
    if !unserved.is_empty() {
        out.push(Finding {
            reason: DiagnosisReason::ModelNotServed,
            message: format!(
                "spec.models names {} but the engines serve {}: clients asking for it or its aliases get errors; set models[].name to a served name (the engines' --served-model-name)",
                unserved.join(", "),
                list(served.iter())
            ),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{self, tests::mk_slice};
    use crate::probe::{EndpointModels, EngineActivity, KvWindow, ModelCard, ProbeFailure};
    use crate::tests::mk_spec;
    use DiagnosisReason as R;

    fn card(id: &str) -> ModelCard {
        ModelCard {
            id: id.into(),
            max_model_len: Some(4096),
            parent: None,
            root: None,
            owned_by: None,
        }
    }

    fn answered(endpoint: &str, ids: &[&str]) -> EndpointModels {
        EndpointModels {
            endpoint: endpoint.into(),
            outcome: Ok(ids.iter().map(|i| card(i)).collect()),
        }
    }

    fn failed(endpoint: &str, f: ProbeFailure) -> EndpointModels {
        EndpointModels {
            endpoint: endpoint.into(),
            outcome: Err(f),
        }
    }

    fn healthy_endpoints(spec: &InferenceWorkerSetSpec) -> Resolution {
        let s = mk_slice(
            "a",
            "qwen-vllm",
            &[("http", 8000), ("kv-pub", 5557)],
            &[("10.0.0.1", None), ("10.0.0.2", None)],
        );
        resolve(spec, &[s])
    }

    fn resolve(
        spec: &InferenceWorkerSetSpec,
        slices: &[k8s_openapi::api::discovery::v1::EndpointSlice],
    ) -> Resolution {
        endpoints::resolve(spec, slices)
    }

    /// A window of 10 s on 10.0.0.1:5557; `activity` is (requests, tokens
    /// computed).
    fn subscribed(block_sizes: &[u32], batches: u64, activity: Option<(u64, u64)>) -> KvProbe {
        KvProbe::Observed(KvObservation::Subscribed(KvWindow {
            publishers: vec!["10.0.0.1:5557".into()],
            discovered: true,
            window_ms: 10_000,
            batches,
            block_sizes: block_sizes.iter().copied().collect(),
            activity: activity.map(|(requests, tokens_computed)| EngineActivity {
                requests,
                tokens_computed,
                engine_block_size: None,
            }),
        }))
    }

    fn reasons(f: &[Finding]) -> Vec<R> {
        f.iter().map(|f| f.reason).collect()
    }

    /// Every diagnosis, from the inputs that make it, with the words its
    /// message must contain.
    #[test]
    fn table_of_diagnoses() {
        let spec = mk_spec(
            "qwen-vllm",
            "http",
            Some("kv-pub"),
            &[("Qwen/Qwen3", &["qwen"])],
        );
        let qwen = ["Qwen/Qwen3"];
        let ok_models = vec![
            answered("10.0.0.1:8000", &qwen),
            answered("10.0.0.2:8000", &qwen),
        ];
        let cases: Vec<(&str, ProbeResult, Vec<R>, Vec<&str>)> = vec![
            (
                "healthy, KV not probed yet",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: KvProbe::NotProbed,
                },
                vec![],
                vec![],
            ),
            (
                "healthy, KV seen at the right width",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: subscribed(&[16], 40, Some((7, 5000))),
                },
                vec![],
                vec![],
            ),
            (
                "endpoints disagree",
                ProbeResult {
                    models: vec![
                        answered("10.0.0.1:8000", &qwen),
                        answered("10.0.0.2:8000", &["google/gemma-4-12b-it"]),
                    ],
                    kv: KvProbe::NotProbed,
                },
                vec![R::ModelMismatch],
                vec![
                    "Qwen/Qwen3 on 10.0.0.1:8000",
                    "google/gemma-4-12b-it on 10.0.0.2:8000",
                    "--served-model-name",
                ],
            ),
            (
                "declared model (and its alias) not served",
                ProbeResult {
                    models: vec![
                        answered("10.0.0.1:8000", &["Qwen/Qwen3-8B"]),
                        answered("10.0.0.2:8000", &["Qwen/Qwen3-8B"]),
                    ],
                    kv: KvProbe::NotProbed,
                },
                vec![R::ModelNotServed],
                vec!["\"Qwen/Qwen3\" (aliases qwen)", "serve Qwen/Qwen3-8B"],
            ),
            (
                "one endpoint unreachable",
                ProbeResult {
                    models: vec![
                        answered("10.0.0.1:8000", &qwen),
                        failed(
                            "10.0.0.2:8000",
                            ProbeFailure::Connect("connection refused".into()),
                        ),
                    ],
                    kv: KvProbe::NotProbed,
                },
                vec![R::ModelsUnreachable],
                vec![
                    "1 of 2 ready endpoints",
                    "10.0.0.2:8000: cannot connect: connection refused",
                    "serviceRef.port \"http\"",
                ],
            ),
            (
                "all unreachable: no model verdict",
                ProbeResult {
                    models: vec![
                        failed("10.0.0.1:8000", ProbeFailure::Timeout),
                        failed("10.0.0.2:8000", ProbeFailure::Status(404)),
                    ],
                    kv: KvProbe::NotProbed,
                },
                vec![R::ModelsUnreachable],
                vec![
                    "none of the 2 ready endpoints",
                    "HTTP status 404",
                    "timeout",
                ],
            ),
            (
                "KV port closed",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: KvProbe::Observed(KvObservation::Closed {
                        endpoint: "10.0.0.1:5557".into(),
                        error: "connection refused".into(),
                    }),
                },
                vec![R::KvPortClosed],
                vec![
                    "on 10.0.0.1:5557 (connection refused)",
                    "kvEvents.port \"kv-pub\"",
                    "--kv-events-config",
                ],
            ),
            (
                "no events while serving",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: subscribed(&[], 0, Some((12, 640))),
                },
                vec![R::NoKvEvents],
                vec![
                    "subscribed to 10.0.0.1:5557 for 10 s",
                    "at least 64 new tokens",
                    "--enable-prefix-caching",
                ],
            ),
            (
                "no events, too few tokens for a verdict",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: subscribed(&[], 0, Some((12, 63))),
                },
                vec![],
                vec![],
            ),
            (
                "no events while idle is fine",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: subscribed(&[], 0, Some((0, 0))),
                },
                vec![],
                vec![],
            ),
            (
                "no events, load unknown: no verdict",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: subscribed(&[], 0, None),
                },
                vec![],
                vec![],
            ),
            (
                "the Gemma case: 256-token blocks, kvBlockSize 16",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: subscribed(&[256], 9, Some((3, 100))),
                },
                vec![R::BlockSizeMismatch],
                vec![
                    "carry 256-token blocks but kvBlockSize is 16",
                    "set kvBlockSize: 256",
                ],
            ),
            (
                "several widths",
                ProbeResult {
                    models: ok_models.clone(),
                    kv: subscribed(&[16, 64], 9, Some((3, 100))),
                },
                vec![R::BlockSizeMismatch],
                vec!["16, 64-token blocks", "several KV-cache groups"],
            ),
            (
                "several at once, in code order",
                ProbeResult {
                    models: vec![
                        answered("10.0.0.1:8000", &["a"]),
                        answered("10.0.0.2:8000", &["b"]),
                    ],
                    kv: subscribed(&[32], 0, Some((5, 10_000))),
                },
                vec![
                    R::NoKvEvents,
                    R::BlockSizeMismatch,
                    R::ModelMismatch,
                    R::ModelNotServed,
                ],
                vec![],
            ),
        ];
        let eps = healthy_endpoints(&spec);
        for (name, probe, want, words) in cases {
            let got = diagnose(&spec, &eps, Some(&probe));
            assert_eq!(reasons(&got), want, "{name}: {got:#?}");
            let text: String = got
                .iter()
                .map(|f| f.message.as_str())
                .collect::<Vec<_>>()
                .join("\n");
            for w in words {
                assert!(text.contains(w), "{name}: {w:?} not in {text:?}");
            }
            // Deterministic: the same inputs give the same words.
            assert_eq!(got, diagnose(&spec, &eps, Some(&probe)), "{name}");
        }
    }

    #[test]
    fn nothing_without_probe_or_kv() {
        let spec = mk_spec("qwen-vllm", "http", None, &[]);
        assert!(diagnose(&spec, &healthy_endpoints(&spec), None).is_empty());
    }

    #[test]
    fn lora_adapters_do_not_make_a_mismatch() {
        let spec = mk_spec("qwen-vllm", "http", None, &[]);
        let mut lora = answered("10.0.0.2:8000", &["Qwen/Qwen3", "sql"]);
        if let Ok(cards) = &mut lora.outcome {
            cards[1].parent = Some("Qwen/Qwen3".into());
        }
        let probe = ProbeResult {
            models: vec![answered("10.0.0.1:8000", &["Qwen/Qwen3"]), lora],
            kv: KvProbe::NotConfigured,
        };
        assert!(diagnose(&spec, &healthy_endpoints(&spec), Some(&probe)).is_empty());
    }

    #[test]
    fn kv_port_missing_on_some_endpoints() {
        let spec = mk_spec("qwen-vllm", "http", Some("kv-pub"), &[]);
        let with = mk_slice(
            "a",
            "qwen-vllm",
            &[("http", 8000), ("kv-pub", 5557)],
            &[("10.0.0.1", None)],
        );
        let without = mk_slice(
            "b",
            "qwen-vllm",
            &[("http", 8000)],
            &[("10.0.0.2", None), ("10.0.0.3", None)],
        );
        let got = diagnose(&spec, &resolve(&spec, &[with, without]), None);
        assert_eq!(reasons(&got), [R::KvPortMissing]);
        assert!(
            got[0]
                .message
                .contains("2 of 3 ready endpoints (10.0.0.2, 10.0.0.3)"),
            "{}",
            got[0].message
        );
        assert!(got[0].message.contains("\"kv-pub\""), "{}", got[0].message);
    }

    #[test]
    fn long_lists_are_cut() {
        assert_eq!(list(["a", "b"]), "a, b");
        assert_eq!(
            list((0..8).map(|i| i.to_string())),
            "0, 1, 2, 3, 4 and 3 more"
        );
    }
}
