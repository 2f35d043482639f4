//! `InferenceWorkerSet`: a set of engine pods serving one model, wrapping a Service.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::{DEFAULT_PROFILE, PORT_RULE, PORT_RULE_MESSAGE};

/// The engines of one worker set: which Service they sit behind, how wide the
/// blocks of their KV-cache events are, and which models they serve.
///
/// ```yaml
/// spec:
///   profile: default
///   kvBlockSize: 16
///   serviceRef: {name: qwen-vllm, port: http}
///   kvEvents: {port: kv-pub}
///   models:
///     - name: Qwen/Qwen3.6-35B-A3B
///       aliases: [qwen3.6]
/// ```
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "kinference.buoyant.io",
    version = "v1alpha1",
    kind = "InferenceWorkerSet",
    plural = "inferenceworkersets",
    shortname = "iws",
    category = "kinference",
    namespaced,
    status = "InferenceWorkerSetStatus",
    doc = "A set of vLLM or SGLang engine pods behind one Service, serving one model. The router sends each request to the engine of the set that will answer soonest, using the KV-cache events the engines publish.",
    printcolumn(
        name = "READY",
        type_ = "integer",
        json_path = ".status.readyEndpoints",
        description = "Ready endpoints behind the Service"
    ),
    printcolumn(
        name = "STATE",
        type_ = "string",
        json_path = ".status.state",
        description = "Accepted, or the reason the spec is rejected; plus NotReady and Unreferenced"
    ),
    printcolumn(
        name = "AGE",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.models) || self.models.all(m, self.models.filter(n, n.name == m.name).size() == 1)")
        .message("each model name may appear only once in models")
        .field_path(".models"),
    validation = Rule::new("!has(self.models) || self.models.all(m, !has(m.aliases) || m.aliases.all(a, self.models.filter(n, has(n.aliases) && a in n.aliases).size() == 1 && m.aliases.filter(b, b == a).size() == 1))")
        .message("each alias may appear only once in a worker set")
        .field_path(".models"),
    validation = Rule::new("!has(self.models) || self.models.all(m, !has(m.aliases) || m.aliases.all(a, !self.models.exists(n, n.name == a)))")
        .message("an alias must differ from every model name in the worker set, its own model's included")
        .field_path(".models")
)]
pub struct InferenceWorkerSetSpec {
    /// Name of the RoutingProfile (latency model and tokenization mode) used for
    /// these engines. `default` is built in.
    #[serde(default = "default_profile")]
    #[x_kube(validation = Rule::new("size(self) > 0").message("profile must not be empty (omit it to use the built-in profile 'default')"))]
    #[schemars(length(max = 253))]
    pub profile: String,

    /// Tokens per block in the KV-cache events these engines publish. This is
    /// the block width of the events, which can differ from the engine's
    /// `--block-size` (SGLang can publish 1-token pages; Gemma-style models
    /// publish 256-token blocks).
    #[x_kube(validation = Rule::new("self >= 1").message("kvBlockSize must be at least 1: it is the number of tokens per block in the engines' KV events"))]
    #[schemars(schema_with = "super::positive_int32")]
    pub kv_block_size: u32,

    /// The Service in front of the engines and its OpenAI API port.
    pub service_ref: ServiceRef,

    /// Where the engines publish KV-cache events (ZeroMQ PUB). Unset: no KV
    /// information, so routing falls back to load alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsRef>,

    /// Models served by these engines, with the aliases clients may use.
    /// Optional: models are discovered from the engines' `/v1/models`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub models: Vec<ModelSpec>,
}

fn default_profile() -> String {
    DEFAULT_PROFILE.to_owned()
}

/// A Service and one of its ports, by name or number.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceRef {
    /// Name of the Service, in the worker set's namespace. Its endpoints are
    /// found through EndpointSlices labelled `kubernetes.io/service-name`.
    #[x_kube(validation = Rule::new("size(self) > 0").message("serviceRef.name must not be empty"))]
    #[schemars(length(max = 253))]
    pub name: String,

    /// The engines' OpenAI API port: a port name of the Service or a number.
    #[x_kube(validation = Rule::new(PORT_RULE).message(PORT_RULE_MESSAGE))]
    pub port: IntOrString,
}

/// Where the engines publish KV-cache events.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KvEventsRef {
    /// The ZeroMQ PUB port: a port name of the Service or a number.
    #[x_kube(validation = Rule::new(PORT_RULE).message(PORT_RULE_MESSAGE))]
    pub port: IntOrString,

    /// The replay (ROUTER) port the engines were started with
    /// (`replay_endpoint` of vLLM's `--kv-events-config`), a port name of
    /// the Service or a number. Unset: replay only where the engines say they
    /// have one (vLLM ≥ 0.31 `/kv_event_sources`, SGLang `/server_info`);
    /// without replay, a lost batch costs the index that engine's blocks
    /// until it reports them again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(PORT_RULE).message(PORT_RULE_MESSAGE))]
    pub replay_port: Option<IntOrString>,
}

/// A model the engines serve, and other names clients may ask for it by.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// The name the engines serve (`--served-model-name`, as in `/v1/models`).
    #[x_kube(validation = Rule::new("size(self) > 0").message("a model name must not be empty"))]
    #[schemars(length(max = 253))]
    pub name: String,

    /// Other names clients may send in `model`; the router rewrites them to
    /// `name` before forwarding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(a, size(a) > 0)").message("an alias must not be empty"))]
    #[schemars(length(max = 16), inner(length(max = 253)))]
    pub aliases: Vec<String>,
}

/// What the controller observed about a worker set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct InferenceWorkerSetStatus {
    /// Ready endpoints behind the Service (deduplicated across EndpointSlices).
    #[serde(default)]
    pub ready_endpoints: i32,

    /// `Accepted`, or the reasons the spec is rejected; plus `NotReady` and
    /// `Unreferenced`, comma-joined, e.g. `Accepted,NotReady`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub state: String,

    /// Conditions `Accepted`, `Ready` and `Referenced`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,

    /// Models the engines serve, as discovered from their `/v1/models`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub models: Vec<ServedModel>,

    /// Findings a person should act on that do not stop routing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["reason".into()]))]
    pub diagnoses: Vec<Diagnosis>,

    /// The `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A model as the engines report it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ServedModel {
    /// The served model name.
    pub name: String,
    /// Context length (`max_model_len`), when the engines report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<i64>,
    /// Aliases in effect for this model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
}

/// A finding about a worker set that a person should fix, though routing goes on.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Diagnosis {
    /// A stable code (e.g. `BlockSizeMismatch`, `NoKvEvents`).
    pub reason: String,
    /// What was seen and what to change.
    pub message: String,
    /// When this finding was first made (it keeps its time while it persists).
    pub since: Time,
}
