//! Typed objects read from YAML manifests, for running without a cluster.
//!
//! A router started with `--manifests DIR` reads the same objects a cluster
//! would hold (worker sets, pools, profiles and the EndpointSlices of the
//! worker sets' Services) from YAML files. This module turns the text of one
//! file into typed [`Object`]s and validates each kinference object with the
//! same CEL rules the API server applies (feature `cel`), so an object that a
//! cluster would refuse is refused here too, with the same message. Reading
//! the files is the caller's job.

use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::Value;

use crate::v1alpha1::{API_VERSION, InferencePool, InferenceWorkerSet, RoutingProfile};

/// One object of a manifest file.
#[derive(Clone, Debug)]
pub enum Object {
    /// `kinference.buoyant.io/v1alpha1` `InferenceWorkerSet`.
    WorkerSet(Box<InferenceWorkerSet>),
    /// `kinference.buoyant.io/v1alpha1` `InferencePool`.
    Pool(Box<InferencePool>),
    /// `kinference.buoyant.io/v1alpha1` `RoutingProfile`.
    Profile(Box<RoutingProfile>),
    /// `discovery.k8s.io/v1` `EndpointSlice`.
    EndpointSlice(Box<EndpointSlice>),
    /// Any other kind: not used by kinference, reported so callers can say so.
    Other {
        /// Its `apiVersion`.
        api_version: String,
        /// Its `kind`.
        kind: String,
        /// Its `metadata.name`, if any.
        name: Option<String>,
    },
}

impl Object {
    /// `Kind/name` for messages.
    pub fn describe(&self) -> String {
        fn name(m: &kube::core::ObjectMeta) -> &str {
            m.name.as_deref().unwrap_or("")
        }
        match self {
            Object::WorkerSet(o) => format!("InferenceWorkerSet/{}", name(&o.metadata)),
            Object::Pool(o) => format!("InferencePool/{}", name(&o.metadata)),
            Object::Profile(o) => format!("RoutingProfile/{}", name(&o.metadata)),
            Object::EndpointSlice(o) => format!("EndpointSlice/{}", name(&o.metadata)),
            Object::Other { kind, name, .. } => {
                format!("{kind}/{}", name.as_deref().unwrap_or(""))
            }
        }
    }
}

/// Why a manifest document was refused.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The text is not YAML.
    #[error("not valid YAML")]
    Yaml(#[source] Box<serde_saphyr::Error>),
    /// A document is not a mapping with `apiVersion` and `kind`.
    #[error("document {doc}: {message}")]
    Shape {
        /// 1-based document number in the file.
        doc: usize,
        /// What is wrong.
        message: String,
    },
    /// A document does not match its kind's schema.
    #[error("document {doc} ({object}): {source}")]
    Schema {
        /// 1-based document number in the file.
        doc: usize,
        /// `Kind/name`.
        object: String,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// A document breaks a validation rule of its kind.
    #[error("document {doc} ({object}) is invalid: {message}")]
    Invalid {
        /// 1-based document number in the file.
        doc: usize,
        /// `Kind/name`.
        object: String,
        /// The rules broken, with their messages.
        message: String,
    },
}

/// Parses every document of a YAML file into objects.
///
/// Empty documents are skipped. Each kinference object is checked against its
/// schema and validation rules.
///
/// # Errors
/// The first document that cannot be parsed or is invalid; documents are
/// numbered from 1.
pub fn parse(text: &str) -> Result<Vec<Object>, ManifestError> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(text).map_err(|e| ManifestError::Yaml(Box::new(e)))?;
    let mut out = Vec::with_capacity(docs.len());
    for (i, doc) in docs.into_iter().enumerate() {
        if doc.is_null() {
            continue;
        }
        out.push(parse_value(i + 1, doc)?);
    }
    Ok(out)
}

fn parse_value(doc: usize, value: Value) -> Result<Object, ManifestError> {
    let shape = |message: &str| ManifestError::Shape {
        doc,
        message: message.to_owned(),
    };
    let map = value
        .as_object()
        .ok_or_else(|| shape("not a mapping (expected an object with apiVersion and kind)"))?;
    let api_version = map
        .get("apiVersion")
        .and_then(Value::as_str)
        .ok_or_else(|| shape("no apiVersion"))?
        .to_owned();
    let kind = map
        .get("kind")
        .and_then(Value::as_str)
        .ok_or_else(|| shape("no kind"))?
        .to_owned();
    let name = map
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let object = format!("{kind}/{}", name.as_deref().unwrap_or(""));

    let known = matches!(
        (api_version.as_str(), kind.as_str()),
        (
            API_VERSION,
            "InferenceWorkerSet" | "InferencePool" | "RoutingProfile"
        ) | ("discovery.k8s.io/v1", "EndpointSlice")
    );
    if !known {
        return Ok(Object::Other {
            api_version,
            kind,
            name,
        });
    }
    if name.as_deref().is_none_or(str::is_empty) {
        return Err(ManifestError::Invalid {
            doc,
            object,
            message: "metadata.name must not be empty".into(),
        });
    }
    let schema_err = |source| ManifestError::Schema {
        doc,
        object: object.clone(),
        source,
    };
    let parsed = match kind.as_str() {
        "InferenceWorkerSet" => {
            Object::WorkerSet(Box::new(serde_json::from_value(value).map_err(schema_err)?))
        }
        "InferencePool" => {
            Object::Pool(Box::new(serde_json::from_value(value).map_err(schema_err)?))
        }
        "RoutingProfile" => {
            Object::Profile(Box::new(serde_json::from_value(value).map_err(schema_err)?))
        }
        _ => Object::EndpointSlice(Box::new(serde_json::from_value(value).map_err(schema_err)?)),
    };
    if let Err(message) = validate(&parsed) {
        return Err(ManifestError::Invalid {
            doc,
            object,
            message,
        });
    }
    Ok(parsed)
}

/// Checks a kinference object against the validation rules of its CRD, as the
/// API server would. EndpointSlices and other kinds pass.
///
/// # Errors
/// The broken rules' messages, joined with `; `.
#[cfg(feature = "cel")]
pub fn validate(object: &Object) -> Result<(), String> {
    use kube::CustomResourceExt;
    fn check<K: CustomResourceExt + serde::Serialize>(o: &K) -> Result<(), String> {
        let crd = K::crd();
        let schema = crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .map(serde_json::to_value)
            .ok_or("the CRD has no schema")?
            .map_err(|e| e.to_string())?;
        let value = serde_json::to_value(o).map_err(|e| e.to_string())?;
        kube::core::cel::Validator::new()
            .validate(&schema, &value, None)
            .map_err(|errs| {
                errs.as_slice()
                    .iter()
                    .map(|e| format!("{}: {}", e.field_path, e.message))
                    .collect::<Vec<_>>()
                    .join("; ")
            })
    }
    match object {
        Object::WorkerSet(o) => check(o.as_ref()),
        Object::Pool(o) => check(o.as_ref()),
        Object::Profile(o) => check(o.as_ref()),
        Object::EndpointSlice(_) | Object::Other { .. } => Ok(()),
    }
}

/// Without the `cel` feature, objects are only checked against their types.
///
/// # Errors
/// Never.
#[cfg(not(feature = "cel"))]
pub fn validate(_object: &Object) -> Result<(), String> {
    Ok(())
}
