//! A vLLM-compatible engine simulator.
//!
//! **Status: skeleton.** This crate will serve the OpenAI API, `/metrics`,
//! `/tokenize` and KV events byte-compatible with vLLM, with a prefix cache,
//! continuous batching and a latency model, so routing can be tested and
//! measured without GPUs. It exports nothing yet.
