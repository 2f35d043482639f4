//! `kinference.buoyant.io/v1alpha1`.

mod pool;
mod profile;
mod worker_set;

pub use pool::{
    InferencePool, InferencePoolSpec, InferencePoolStatus, NameConflict, OfferedModel, WorkerSetRef,
};
pub use profile::{
    Admission, ConfigMapRef, LatencyModel, RoutingProfile, RoutingProfileSpec, TenantSpec,
    TierCredits, Tokenization, TokenizationMode, TokenizerSource,
};
pub use worker_set::{
    Diagnosis, InferenceWorkerSet, InferenceWorkerSetSpec, InferenceWorkerSetStatus, KvEventsRef,
    ModelSpec, ServedModel, ServiceRef,
};

/// The API group of every kind here.
pub const GROUP: &str = "kinference.buoyant.io";
/// The API version of every kind here.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` as written in manifests.
pub const API_VERSION: &str = "kinference.buoyant.io/v1alpha1";

/// The profile a worker set uses when it names none.
pub const DEFAULT_PROFILE: &str = "default";

/// CEL rule for a port given by name or number (an `IntOrString`): a number
/// from 1 to 65535, or an IANA service name as Kubernetes port names are (a
/// name has at least one letter, so an all-digit string is read as a number,
/// as the router and controller do). Written with `string(self)` rather than
/// `type(self)` so that the client-side CEL evaluator understands it too.
pub(crate) const PORT_RULE: &str = "string(self).matches('^[0-9]+$') ? (int(string(self)) >= 1 && int(string(self)) <= 65535) : (size(string(self)) <= 15 && string(self).matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && string(self).matches('[a-z]') && !string(self).contains('--'))";
pub(crate) const PORT_RULE_MESSAGE: &str = "port must be a number from 1 to 65535 or a port name of the Service (at most 15 lowercase letters, digits and '-', with at least one letter)";

/// Schema of a positive integer that fits an `int32` (what Kubernetes expects
/// for integers; schemars would say `uint32`, which API servers warn about).
/// The lower bound is a CEL rule on the field, so that the API server gives
/// its message alone.
pub(crate) fn positive_int32(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "integer",
        "format": "int32",
        "maximum": i32::MAX,
    })
}
