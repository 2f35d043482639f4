//! `RoutingProfile`: a latency model and a tokenization mode, cluster-scoped.

// `Admission`'s fields are the CRD's names (`maxQueue`, `maxWaitMillis`, …):
// limits read as such. KubeSchema re-emits the struct, so the allow cannot
// sit on it.
#![allow(clippy::struct_field_names)]

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// How a router tokenizes prompts and predicts time to first token for the
/// worker sets that name this profile. The profile `default` is built in; an
/// object of that name overrides it.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "kinference.buoyant.io",
    version = "v1alpha1",
    kind = "RoutingProfile",
    plural = "routingprofiles",
    category = "kinference",
    doc = "A routing profile: how the router turns prompts into token ids (local tokenizer, the engine's /tokenize, or approximate) and the latency model it predicts time to first token with.",
    printcolumn(
        name = "TOKENIZATION",
        type_ = "string",
        json_path = ".spec.tokenization.mode",
        description = "local, engine or approximate"
    ),
    printcolumn(
        name = "CALIBRATE",
        type_ = "boolean",
        json_path = ".spec.latency.calibrate",
        description = "Whether the latency model is calibrated online"
    ),
    printcolumn(
        name = "AGE",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct RoutingProfileSpec {
    /// How prompts become token ids.
    #[serde(default)]
    pub tokenization: Tokenization,

    /// The latency model. Unset fields take the built-in `default` profile's values.
    #[serde(default)]
    pub latency: LatencyModel,

    /// Admission control in the router, past the knee: a request whose
    /// predicted time to first token exceeds `maxPredictedTtftMillis` on
    /// every engine waits in the router (not on an engine) until one frees
    /// up, or is answered 429 with `Retry-After`. Unset: off, every request
    /// is sent at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<Admission>,
}

/// Admission control: a bounded queue in the router between preparing a
/// request and choosing its engine.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Admission {
    /// Hold a request while every candidate engine's predicted time to first
    /// token exceeds this, in milliseconds.
    #[x_kube(validation = Rule::new("self > 0.0").message("admission.maxPredictedTtftMillis must be greater than 0"))]
    pub max_predicted_ttft_millis: f64,

    /// Requests held at most per worker set; one more is answered 429
    /// (`queue_full`). Default 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100000").message("admission.maxQueue must be between 1 and 100000"))]
    pub max_queue: Option<u32>,

    /// Longest a request is held before it is answered 429 (`deadline`), in
    /// milliseconds. Default 10000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 600000").message("admission.maxWaitMillis must be between 1 and 600000"))]
    pub max_wait_millis: Option<u64>,

    /// Tenants with a weight other than 1, or named by the model or alias
    /// their requests ask for. While requests wait, tenants share the
    /// release order in proportion to their weights (by uncached prefill
    /// tokens); a tenant not listed weighs 1.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(
        validation = Rule::new("self.all(t, self.filter(u, u.name == t.name).size() == 1)")
            .message("admission.tenants: each tenant may be listed only once"),
        validation = Rule::new("self.all(t, !has(t.models) || t.models.all(m, t.models.filter(n, n == m).size() == 1 && self.filter(u, has(u.models) && m in u.models).size() == 1))")
            .message("admission.tenants: a model or alias may name only one tenant, once")
    )]
    #[schemars(length(max = 32))]
    pub tenants: Vec<TenantSpec>,
}

impl Admission {
    /// `maxQueue` when unset.
    pub const DEFAULT_MAX_QUEUE: u32 = 512;
    /// `maxWaitMillis` when unset.
    pub const DEFAULT_MAX_WAIT_MILLIS: u64 = 10_000;
}

/// One tenant's share of the admission queue, and the models or aliases
/// whose requests count as this tenant's.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TenantSpec {
    /// The tenant, as a client key names it or `x-kinference-tenant` carries
    /// it.
    #[x_kube(validation = Rule::new("size(self) > 0").message("admission.tenants[].name must not be empty"))]
    #[schemars(length(max = 64))]
    pub name: String,

    /// Its weight: a tenant of weight 2 is released twice the uncached
    /// prefill tokens of a tenant of weight 1 while both wait. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1000").message("admission.tenants[].weight must be between 1 and 1000"))]
    pub weight: Option<u32>,

    /// Requests for these model names or aliases count as this tenant's
    /// when the client's API key names no tenant (the key wins; then the
    /// model; then the `x-kinference-tenant` header).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(m, size(m) > 0)").message("admission.tenants[].models: a model name must not be empty"))]
    #[schemars(length(max = 8), inner(length(max = 253)))]
    pub models: Vec<String>,
}

impl TenantSpec {
    /// `weight` when unset.
    pub const DEFAULT_WEIGHT: u32 = 1;
}

/// How prompts become token ids.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.mode != 'local' || has(self.tokenizer)")
        .message("tokenization mode 'local' needs a tokenizer: tokenizer.path")
)]
pub struct Tokenization {
    /// `local`: in-process tokenizer.json and chat template; `engine`: ask the
    /// engine's `/tokenize`; `approximate`: no token ids, route on the router's
    /// own record of prompt prefixes.
    #[serde(default)]
    pub mode: TokenizationMode,

    /// Where `local` mode finds `tokenizer.json` and `tokenizer_config.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSource>,
}

/// Tokenization mode.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum TokenizationMode {
    /// In-process tokenizer and chat template.
    Local,
    /// The engine's `/tokenize` endpoint.
    #[default]
    Engine,
    /// No token ids: the router's own record of prompt prefixes.
    Approximate,
}

impl TokenizationMode {
    /// The name as written in the spec.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Engine => "engine",
            Self::Approximate => "approximate",
        }
    }
}

/// Where to load a tokenizer from: a directory in the router's filesystem.
///
/// `configMap` is refused by the API server: a ConfigMap holds at most
/// 1 MiB, less than most models' `tokenizer.json` (Qwen3's is 11 MB), so a
/// source that could only ever work for small tokenizers is not offered.
/// Mount the files instead (a ConfigMap or image volume for small ones, a
/// PVC or the model's own volume) and give their directory as `path`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.configMap)")
        .message("tokenizer.configMap is not supported: a ConfigMap holds at most 1 MiB, less than most tokenizer.json files; mount the files into the router pods (a ConfigMap or image volume, or a PVC) and give their directory as tokenizer.path"),
    validation = Rule::new("has(self.path)")
        .message("tokenizer.path is required")
)]
pub struct TokenizerSource {
    /// Not supported, refused (kept so that the refusal can say why): a
    /// ConfigMap holding `tokenizer.json` and `tokenizer_config.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ConfigMapRef>,

    /// A directory in the router's filesystem holding the same files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("size(self) > 0").message("tokenizer.path must not be empty"))]
    #[schemars(length(max = 4096))]
    pub path: Option<String>,
}

/// A ConfigMap by namespace and name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapRef {
    /// Namespace of the ConfigMap (profiles are cluster-scoped).
    #[x_kube(validation = Rule::new("size(self) > 0").message("configMap.namespace must not be empty"))]
    #[schemars(length(max = 63))]
    pub namespace: String,
    /// Name of the ConfigMap.
    #[x_kube(validation = Rule::new("size(self) > 0").message("configMap.name must not be empty"))]
    #[schemars(length(max = 253))]
    pub name: String,
}

/// Latency-model parameters. Predicted time to first token = queueing (prefill
/// work ahead ÷ throughput, plus decode pressure) + uncached prompt tokens ÷
/// throughput + base. Every field is optional; unset fields take the built-in
/// `default` profile's value.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct LatencyModel {
    /// Prefill throughput of one engine, in prompt tokens per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self > 0.0").message("prefillTokensPerSecond must be greater than 0"))]
    pub prefill_tokens_per_second: Option<f64>,

    /// Fixed cost of every request before its first token, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0").message("baseMillis must not be negative"))]
    pub base_millis: Option<f64>,

    /// Delay each running (decoding) request adds to a new request's first
    /// token, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0").message("decodeCostMillis must not be negative"))]
    pub decode_cost_millis: Option<f64>,

    /// How much a cached block counts, by where it is held (GPU 1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier_credits: Option<TierCredits>,

    /// How much later a warm endpoint's predicted first token may be than a
    /// cold one's before the router goes cold, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0").message("toleranceMillis must not be negative"))]
    pub tolerance_millis: Option<f64>,

    /// Correct the model online per endpoint from observed time to first token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibrate: Option<bool>,

    /// With `calibrate`, learn the engines' step costs (step overhead, decode
    /// cost, prefill speed) from the gaps between streamed tokens and predict
    /// with them (default true). Turn off where stream chunks are not one
    /// token each (vLLM `--stream-interval` above 1, speculative decoding)
    /// and responses carry no `usage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learn_step_costs: Option<bool>,
}

/// Credit for a cached block by tier: 1 means as good as GPU-resident, 0 worthless.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TierCredits {
    /// Blocks in GPU memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0 && self <= 1.0").message("tierCredits.gpu must be between 0 and 1"))]
    pub gpu: Option<f64>,
    /// Blocks offloaded to CPU memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0 && self <= 1.0").message("tierCredits.cpu must be between 0 and 1"))]
    pub cpu: Option<f64>,
    /// Blocks offloaded to local disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0 && self <= 1.0").message("tierCredits.disk must be between 0 and 1"))]
    pub disk: Option<f64>,
    /// Blocks in shared or remote storage (vLLM's `STORAGE` medium: file
    /// systems, object stores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0.0 && self <= 1.0").message("tierCredits.storage must be between 0 and 1"))]
    pub storage: Option<f64>,
}
