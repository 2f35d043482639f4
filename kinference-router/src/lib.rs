//! The kinference router.
//!
//! **Status: skeleton.** This crate will hold the router binary and its
//! library: sources of truth (Kubernetes watches or a manifests directory),
//! tokenization, KV-event subscriptions, scoring, the streaming proxy and the
//! admin endpoints. It exports nothing and builds no binary yet.
