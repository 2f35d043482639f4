//! An OpenAI request to the exact token ids vLLM computes.
//!
//! **Status: skeleton.** This crate will load a model's `tokenizer.json`
//! and chat template, render chat requests the way vLLM does, tokenize, and
//! cache the ids of rendered prefixes for multi-turn chats. It exports
//! nothing yet.
