//! The kinference router.
//!
//! **Status: in progress.** Built so far: the [`catalog`] of the pool's
//! objects (apply/delete/reset per kind, snapshots on a watch channel) and
//! its [`source`]s (Kubernetes watches, or a directory of YAML manifests
//! reloaded on change). The request path, KV-event subscriptions, scoring and
//! admin endpoints are not built yet.

pub mod catalog;
pub mod endpoint;
pub mod openai;
pub mod probe;
pub mod proxy;
pub mod source;
pub mod view;
