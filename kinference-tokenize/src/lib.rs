//! An OpenAI request to the exact token ids vLLM computes, fast enough for
//! the request path.
//!
//! Cache-aware routing is only as good as its token ids: one id off early
//! in a prompt and every block key after it differs. This crate reproduces
//! what vLLM (with transformers' tokenizer) does to a `/v1/completions`,
//! `/v1/chat/completions` or `/tokenize` body, in-process, from the model's
//! `tokenizer.json` and `tokenizer_config.json`. It is used by the router
//! (routing keys) and by the simulator (its `/tokenize` and prompt lengths).
//!
//! # Data model
//!
//! * [`ModelFiles`]: a model's tokenizer files by name, read from a
//!   directory or given as a ConfigMap's entries.
//! * [`ModelTokenizer`]: loaded once per model from those files and shared
//!   (`Arc`, `Send + Sync`). Holds the `tokenizers` pipeline (truncation and
//!   padding off, post-processor as transformers sets it), the compiled chat
//!   template(s), the special tokens map, and a [`SegmentCache`].
//! * [`Request`] ([`CompletionRequest`] | [`ChatRequest`]): the id-relevant
//!   fields of a body, parsed per [`Endpoint`] (defaults differ:
//!   completions add special tokens, chat does not).
//! * [`Tokenized`]: the ids (one list per completion prompt, one for chat)
//!   and, for chat, the rendered prompt.
//!
//! # How a request becomes ids (vLLM's path)
//!
//! * Completions: each text prompt is `encode(prompt, add_special_tokens)`
//!   (default true); token-id prompts pass through unchanged. Special-token
//!   strings inside text are matched as special tokens.
//! * Chat: messages are normalised ([`RenderInputs::from_request`]: text
//!   parts joined with `"\n"`, `null` content as `""`, tool-call arguments
//!   parsed into objects, `reasoning_content` → `reasoning`, tools
//!   model-dumped), rendered with the chat template in a transformers-like
//!   Jinja environment (`trim_blocks`, `lstrip_blocks`, Python-compatible
//!   `tojson` with key order preserved, `raise_exception`, `strftime_now`,
//!   Python string/dict methods), cut for `continue_final_message`, then
//!   encoded with `add_special_tokens` (default false).
//!
//! # Invariants
//!
//! * Cached and uncached tokenization give the same ids, always. The cache
//!   stores ids of *segments*: pieces of a text between exact cut points,
//!   positions where an added token (e.g. `<|im_start|>`) is matched in a
//!   way that cannot depend on the text before it (see the `segment`
//!   module docs). The `tokenizers` pipeline never lets a merge, normalizer
//!   or pre-tokenizer span such a position, so the ids of the whole are the
//!   concatenation of the ids of the segments (plus the post-processor's
//!   BOS/EOS, added once). A proptest compares both paths on random
//!   multi-turn chats with adversarial content.
//! * Errors never panic: malformed bodies are [`Error::InvalidRequest`];
//!   template rejections keep the template's message
//!   ([`Error::TemplateRaised`]).
//!
//! # Complexity
//!
//! A request costs rendering (linear in the conversation), one
//! Aho-Corasick scan and one xxh3 hash over the prompt, one cache probe per
//! segment, and BPE only for segments not cached. A new turn of a chat
//! that re-sends its history therefore costs about its new text (measured
//! in the `tokenize` bench). Memory is bounded by the cache's byte budget.
//!
//! # Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use kinference_tokenize::{Endpoint, ModelTokenizer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let tokenizer = Arc::new(ModelTokenizer::from_dir("/models/qwen3")?);
//! let body = serde_json::json!({
//!     "model": "qwen3",
//!     "messages": [{"role": "user", "content": "Hello!"}],
//! });
//! let out = tokenizer.tokenize(Endpoint::ChatCompletions, &body)?;
//! println!("{:?} {:?}", out.prompt, out.first_ids());
//! # Ok(())
//! # }
//! ```
//!
//! In the router, the call goes to a blocking pool under a timeout:
//!
//! ```ignore
//! let t = tokenizer.clone();
//! let ids = tokio::time::timeout(budget, tokio::task::spawn_blocking(move || t.tokenize_request(&body))).await;
//! ```
//!
//! # Not covered
//!
//! Multimodal content parts ([`Error::UnsupportedContent`]), vLLM's
//! `mistral` tokenizer mode (mistral_common), prompt embeddings, and
//! truncation to the engine's context length (only an explicit positive
//! `truncate_prompt_tokens` is applied).

mod cache;
mod chat;
mod error;
mod jinja;
mod load;
mod request;
mod segment;
mod tokenizer;
pub mod word_level;

pub use cache::{CacheStats, SegmentCache};
pub use chat::RenderInputs;
pub use error::{Error, LoadError, NO_CHAT_TEMPLATE_MESSAGE};
pub use jinja::ContentFormat;
pub use load::{
    CHAT_TEMPLATE_JINJA, FILE_NAMES, ModelFiles, SPECIAL_TOKENS_MAP_JSON, TOKENIZER_CONFIG_JSON,
    TOKENIZER_JSON,
};
pub use request::{ChatRequest, CompletionRequest, Endpoint, Prompt, Request, RequestKind};
pub use tokenizer::{ModelTokenizer, Options, Tokenized};
