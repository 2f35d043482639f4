//! Latency model, online calibration and picking for cache-aware routing.
//!
//! **Status: skeleton.** This crate will own the latency-model parameters and
//! the built-in routing profiles' values, predict each endpoint's time to
//! first token from cached blocks and load, calibrate online, pick, and
//! provide baseline policies for benchmarks. It exports nothing yet.
//!
//! Architecture invariant: pure; no I/O, no Kubernetes, no other kinference
//! crate, no wall clock (time and randomness are passed in).
