//! `InferencePool`: what one router serves.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// A group of worker sets served by one router. Clients ask for a model name
/// or alias; the pool maps it to the worker sets serving it.
///
/// Not to be confused with the Gateway API Inference Extension's
/// `InferencePool` (`inference.networking.k8s.io`): this one is its own group.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "kinference.buoyant.io",
    version = "v1alpha1",
    kind = "InferencePool",
    plural = "inferencepools",
    shortname = "ipool",
    category = "kinference",
    namespaced,
    status = "InferencePoolStatus",
    doc = "The worker sets one kinference router serves. Clients ask for a model or alias; the pool maps it to the worker sets serving it.",
    printcolumn(
        name = "MODELS",
        type_ = "string",
        json_path = ".status.modelNames",
        description = "Models offered, comma-joined"
    ),
    printcolumn(
        name = "READY",
        type_ = "integer",
        json_path = ".status.readyEndpoints",
        description = "Ready endpoints over all worker sets"
    ),
    printcolumn(
        name = "AGE",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The worker sets (in the pool's namespace) this pool serves.
    #[x_kube(
        validation = Rule::new("self.all(w, self.filter(v, v.name == w.name).size() == 1)")
            .message("each worker set may be listed only once")
    )]
    #[schemars(length(min = 1, max = 64))]
    pub worker_sets: Vec<WorkerSetRef>,
}

/// A reference to an `InferenceWorkerSet` in the pool's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct WorkerSetRef {
    /// Name of the worker set.
    #[x_kube(validation = Rule::new("size(self) > 0").message("workerSets[].name must not be empty"))]
    #[schemars(length(max = 253))]
    pub name: String,
}

/// What the controller observed about a pool.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolStatus {
    /// Models offered by the pool, with their aliases and worker sets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub models: Vec<OfferedModel>,

    /// The offered model names, comma-joined (the MODELS printer column).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model_names: String,

    /// Ready endpoints over all accepted worker sets.
    #[serde(default)]
    pub ready_endpoints: i32,

    /// Conditions `Accepted` and `ResolvedRefs`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,

    /// Names claimed by more than one worker set of the pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub conflicts: Vec<NameConflict>,

    /// The `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A model offered by a pool.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct OfferedModel {
    /// The model name clients may send.
    pub name: String,
    /// Aliases that map to it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// Worker sets serving it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub worker_sets: Vec<String>,
}

/// A model name or alias claimed by more than one worker set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct NameConflict {
    /// The contested name.
    pub name: String,
    /// The worker sets claiming it.
    pub worker_sets: Vec<String>,
    /// What to change.
    pub message: String,
}
