//! The kinference controller.
//!
//! **Status: skeleton.** This crate will hold the controller binary and its
//! library: reconciling worker sets and pools, writing status with
//! server-side apply, probing endpoints for models and KV events, and
//! diagnoses. It exports nothing and builds no binary yet.
