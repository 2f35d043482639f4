//! KV-cache block index for cache-aware routing.
//!
//! **Status: skeleton.** This crate will hold block keys (a chained 64-bit
//! hash per full block of `kvBlockSize` tokens), the index of which worker
//! holds which blocks (`find_matches`), the engine-agnostic KV events with
//! the vLLM/SGLang msgpack codec, and the ZeroMQ subscriber (feature `zmq`).
//! It exports nothing yet.
//!
//! Architecture invariant: no Kubernetes, no tokio and no wall clock in the
//! index; time is passed in.
