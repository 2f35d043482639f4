//! [`ModelTokenizer`]: one model's tokenizer, chat templates and segment
//! cache, shared by every request for that model.

use std::path::Path;

use serde_json::{Map, Value as Json};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{Encoding, Token};

use crate::cache::{CacheStats, SegmentCache};
use crate::chat::{ChatTemplate, RenderInputs};
use crate::error::{Error, LoadError};
use crate::fast::FastPath;
use crate::jinja::{self, ContentFormat};
use crate::load::{ModelFiles, TOKENIZER_JSON, TokenizerConfig};
use crate::request::{ChatRequest, CompletionRequest, Endpoint, Prompt, Request};
use crate::segment::{Segment, Segmenter};

/// How a [`ModelTokenizer`] is built.
#[derive(Clone, Debug)]
pub struct Options {
    /// Byte budget of the segment cache (0 disables it). Default 64 MiB.
    pub cache_bytes: usize,
    /// Independent lock shards of the cache. Default 16.
    pub cache_shards: usize,
    /// Render a `chat_template` sent in the request (vLLM's
    /// `--trust-request-chat-template`). Default false: such requests fail
    /// with [`Error::UntrustedChatTemplate`], as in vLLM.
    pub trust_request_chat_template: bool,
    /// vLLM's `--chat-template-content-format`. Default
    /// [`ContentFormat::Auto`] (detected from the template).
    pub content_format: ContentFormat,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            cache_bytes: 64 << 20,
            cache_shards: 16,
            trust_request_chat_template: false,
            content_format: ContentFormat::Auto,
        }
    }
}

/// The result of tokenizing a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokenized {
    /// The rendered chat prompt; `None` for completions.
    pub prompt: Option<String>,
    /// The ids: exactly one list for chat; one per prompt for completions
    /// (vLLM runs each prompt of a list as its own request).
    pub token_ids: Vec<Vec<u32>>,
    /// How many of the ids came from the segment cache.
    pub cached_tokens: usize,
}

impl Tokenized {
    /// The ids of the first (for chat: the only) prompt.
    pub fn first_ids(&self) -> &[u32] {
        self.token_ids.first().map_or(&[], Vec::as_slice)
    }

    /// Total number of ids over all prompts.
    pub fn total_tokens(&self) -> usize {
        self.token_ids.iter().map(Vec::len).sum()
    }
}

/// Ids the post-processor puts around a single sequence when
/// `add_special_tokens` is true (e.g. `[1]` and `[]` for a BOS-only
/// template).
#[derive(Clone, Debug, Default)]
struct SpecialWrap {
    prefix: Vec<u32>,
    suffix: Vec<u32>,
}

/// One model's tokenizer: `tokenizer.json`, its chat template(s), special
/// tokens, and a segment cache. Load once per model and share it
/// (`Arc<ModelTokenizer>`): every method takes `&self` and may be called
/// from many threads at once (`Send + Sync`); the cache's locks are sharded
/// and held only for a lookup or an insert.
///
/// All tokenizing methods are synchronous and CPU-bound: call them from a
/// blocking pool (`tokio::task::spawn_blocking`), under a timeout.
#[derive(Debug)]
pub struct ModelTokenizer {
    inner: tokenizers::Tokenizer,
    templates: Vec<(String, ChatTemplate)>,
    globals: Vec<(String, minijinja::Value)>,
    special_tokens_map: Map<String, Json>,
    wrap: Option<SpecialWrap>,
    segmenter: Segmenter,
    fast: Option<FastPath>,
    cache: SegmentCache,
    options: Options,
    clean_up_tokenization_spaces: bool,
    model_max_length: Option<u64>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
}

impl ModelTokenizer {
    /// Loads the tokenizer in `dir` with default [`Options`].
    ///
    /// # Errors
    ///
    /// See [`ModelTokenizer::load`].
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, LoadError> {
        Self::load(&ModelFiles::read_dir(dir)?, Options::default())
    }

    /// Loads a tokenizer from name → bytes entries (a ConfigMap's `data`
    /// and `binaryData`) with default [`Options`].
    ///
    /// # Errors
    ///
    /// See [`ModelTokenizer::load`].
    pub fn from_entries<N, B>(entries: impl IntoIterator<Item = (N, B)>) -> Result<Self, LoadError>
    where
        N: Into<String>,
        B: Into<Vec<u8>>,
    {
        Self::load(&ModelFiles::from_entries(entries), Options::default())
    }

    /// Loads a tokenizer from its files.
    ///
    /// Interprets `tokenizer_config.json` as transformers does: the special
    /// tokens map (template globals), the Llama-family rewrite of the
    /// post-processor from `add_bos_token`/`add_eos_token`,
    /// `split_special_tokens`; drops the truncation and padding stored in
    /// `tokenizer.json` (transformers' `encode` disables them too); compiles
    /// every chat template.
    ///
    /// # Errors
    ///
    /// [`LoadError`] naming the file and the problem: `tokenizer.json`
    /// missing or not a tokenizer, a config field of the wrong shape, a
    /// chat template that does not compile, `add_bos_token` without a BOS
    /// token in the vocabulary.
    pub fn load(files: &ModelFiles, options: Options) -> Result<Self, LoadError> {
        let json = files.get(TOKENIZER_JSON).ok_or(LoadError::Missing {
            file: TOKENIZER_JSON,
        })?;
        let mut inner = tokenizers::Tokenizer::from_bytes(json)
            .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        let config = TokenizerConfig::from_files(files)?;

        inner
            .with_truncation(None)
            .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        inner.with_padding(None);
        if config.split_special_tokens {
            inner.set_encode_special_tokens(true);
        }
        if let Some((add_bos, add_eos)) = config.bos_eos_rewrite() {
            let processor = bos_eos_processor(&inner, &config, add_bos, add_eos)?;
            inner.with_post_processor(Some(processor));
        }

        let mut templates = Vec::with_capacity(config.chat_templates.len());
        for (name, source) in &config.chat_templates {
            let template =
                ChatTemplate::compile(source, options.content_format).map_err(|source| {
                    LoadError::Template {
                        file: config.template_file,
                        name: name.clone(),
                        source,
                    }
                })?;
            templates.push((name.clone(), template));
        }

        let special_tokens_map = config.special_tokens_map();
        let globals = special_tokens_map
            .iter()
            .map(|(k, v)| (k.clone(), jinja::json_to_value(v)))
            .collect();
        let token_id = |attr: &str| {
            config
                .special_token(attr)
                .and_then(|t| inner.token_to_id(t))
        };
        let bos_token_id = token_id("bos_token");
        let eos_token_id = token_id("eos_token");
        let wrap = special_wrap(&inner);
        let segmenter = Segmenter::new(&inner);
        // The fast route relies on the pipeline being the one in the file:
        // not with split_special_tokens (special tokens then stay text).
        let fast = if config.split_special_tokens {
            None
        } else {
            FastPath::from_tokenizer_bytes(json)
        };
        tracing::debug!(
            templates = templates.len(),
            vocab = inner.get_vocab_size(true),
            segmentable = segmenter.can_cut(),
            fast_path = fast.is_some(),
            "tokenizer loaded"
        );
        Ok(ModelTokenizer {
            cache: SegmentCache::new(options.cache_bytes, options.cache_shards),
            inner,
            templates,
            globals,
            special_tokens_map,
            wrap,
            segmenter,
            fast,
            options,
            clean_up_tokenization_spaces: config.clean_up_tokenization_spaces,
            model_max_length: config.model_max_length,
            bos_token_id,
            eos_token_id,
        })
    }

    /// Tokenizes an OpenAI body whose endpoint is not known: `messages`
    /// means `/v1/chat/completions`, `prompt` means `/v1/completions`.
    ///
    /// # Errors
    ///
    /// See [`ModelTokenizer::tokenize`].
    pub fn tokenize_request(&self, body: &Json) -> Result<Tokenized, Error> {
        self.tokenize_parsed(&Request::detect(body)?)
    }

    /// Tokenizes a body sent to `endpoint`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRequest`] for a malformed body; for chat also
    /// [`Error::NoChatTemplate`], [`Error::TemplateRaised`],
    /// [`Error::Template`], [`Error::UnsupportedContent`],
    /// [`Error::UntrustedChatTemplate`].
    pub fn tokenize(&self, endpoint: Endpoint, body: &Json) -> Result<Tokenized, Error> {
        self.tokenize_parsed(&Request::parse(endpoint, body)?)
    }

    /// Tokenizes raw body bytes (JSON); `endpoint` `None` detects the kind.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRequest`] if the bytes are not JSON; otherwise as
    /// [`ModelTokenizer::tokenize`].
    pub fn tokenize_bytes(
        &self,
        endpoint: Option<Endpoint>,
        body: &[u8],
    ) -> Result<Tokenized, Error> {
        let body: Json = serde_json::from_slice(body)
            .map_err(|e| Error::invalid(format!("the body is not JSON: {e}")))?;
        match endpoint {
            Some(endpoint) => self.tokenize(endpoint, &body),
            None => self.tokenize_request(&body),
        }
    }

    /// Tokenizes a parsed request.
    ///
    /// # Errors
    ///
    /// As [`ModelTokenizer::tokenize`].
    pub fn tokenize_parsed(&self, request: &Request) -> Result<Tokenized, Error> {
        match request {
            Request::Completion(c) => self.tokenize_completion(c),
            Request::Chat(c) => self.tokenize_chat(c),
        }
    }

    /// Tokenizes a completion request: each text prompt is encoded (with
    /// `add_special_tokens` as requested), id prompts pass through.
    ///
    /// # Errors
    ///
    /// Only [`Error::Tokenizer`].
    pub fn tokenize_completion(&self, request: &CompletionRequest) -> Result<Tokenized, Error> {
        let mut cached_tokens = 0;
        let mut token_ids = Vec::with_capacity(request.prompts.len());
        for prompt in &request.prompts {
            let mut ids = match prompt {
                Prompt::Text(text) => {
                    let (ids, cached) = self.encode_counting(text, request.add_special_tokens)?;
                    cached_tokens += cached;
                    ids
                }
                Prompt::TokenIds(ids) => ids.clone(),
            };
            truncate_left(&mut ids, request.truncate_prompt_tokens);
            token_ids.push(ids);
        }
        Ok(Tokenized {
            prompt: None,
            token_ids,
            cached_tokens,
        })
    }

    /// Renders a chat request and tokenizes the prompt.
    ///
    /// # Errors
    ///
    /// As [`ModelTokenizer::render_chat`], or [`Error::Tokenizer`].
    pub fn tokenize_chat(&self, request: &ChatRequest) -> Result<Tokenized, Error> {
        let prompt = self.render_chat(request)?;
        let (mut ids, cached_tokens) = self.encode_counting(&prompt, request.add_special_tokens)?;
        truncate_left(&mut ids, request.truncate_prompt_tokens);
        Ok(Tokenized {
            prompt: Some(prompt),
            token_ids: vec![ids],
            cached_tokens,
        })
    }

    /// What vLLM would hand `apply_chat_template` for this request (stage 1
    /// of rendering, normalised for this model's template).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRequest`], [`Error::UnsupportedContent`].
    pub fn render_inputs(&self, request: &ChatRequest) -> Result<RenderInputs, Error> {
        let format = self
            .templates
            .first()
            .map_or(ContentFormat::String, |(_, t)| t.content_format());
        RenderInputs::from_request(request, format)
    }

    /// Renders a chat request to its prompt text, as vLLM does.
    ///
    /// # Errors
    ///
    /// [`Error::NoChatTemplate`] for a model without one;
    /// [`Error::UntrustedChatTemplate`]; [`Error::TemplateRaised`] when the
    /// template rejects the conversation; [`Error::Template`] for other
    /// template failures; [`Error::InvalidRequest`] and
    /// [`Error::UnsupportedContent`] for malformed messages.
    pub fn render_chat(&self, request: &ChatRequest) -> Result<String, Error> {
        let owned;
        let template = match &request.chat_template {
            Some(_) if !self.options.trust_request_chat_template => {
                return Err(Error::UntrustedChatTemplate);
            }
            Some(source) => {
                if let Some((_, t)) = self.templates.iter().find(|(name, _)| name == source) {
                    t
                } else {
                    owned = ChatTemplate::compile(source, self.options.content_format)
                        .map_err(|e| Error::Template(format!("{e:#}")))?;
                    &owned
                }
            }
            None => self.pick_template(request.tools.is_some())?,
        };
        let inputs = RenderInputs::from_request(request, template.content_format())?;
        template.render(&self.globals, &inputs)
    }

    /// transformers' choice among named templates: `tool_use` when tools
    /// are given and it exists, else `default`.
    fn pick_template(&self, tools: bool) -> Result<&ChatTemplate, Error> {
        let named = |name: &str| {
            self.templates
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t)
        };
        (if tools { named("tool_use") } else { None })
            .or_else(|| named("default"))
            .ok_or(Error::NoChatTemplate)
    }

    /// Encodes text as `tokenizer.encode(text, add_special_tokens)` does,
    /// through the segment cache.
    ///
    /// # Errors
    ///
    /// [`Error::Tokenizer`] if the `tokenizers` pipeline fails.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, Error> {
        self.encode_counting(text, add_special_tokens)
            .map(|(ids, _)| ids)
    }

    /// Encodes text with the `tokenizers` pipeline directly, bypassing the
    /// cache (the reference the cache is checked against).
    ///
    /// # Errors
    ///
    /// [`Error::Tokenizer`] if the `tokenizers` pipeline fails.
    pub fn encode_uncached(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, Error> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Cached encoding; also returns how many ids came from the cache.
    fn encode_counting(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, usize), Error> {
        let wrap = match (&self.wrap, add_special_tokens) {
            (_, false) => None,
            (Some(wrap), true) => Some(wrap),
            // A post-processor whose additions could not be worked out:
            // let the pipeline do it.
            (None, true) => return Ok((self.encode_uncached(text, true)?, 0)),
        };
        let mut segments = Vec::new();
        self.segmenter.segments(text, &mut segments);

        let mut ids = Vec::with_capacity(text.len() / 3 + 8);
        if let Some(wrap) = wrap {
            ids.extend_from_slice(&wrap.prefix);
        }
        let mut cached = 0;
        let caching = self.cache.is_enabled();
        for segment in &segments {
            let piece = &text[segment.start..segment.end];
            let before = ids.len();
            if caching {
                let hash = SegmentCache::hash(piece);
                if self.cache.get_into(hash, piece, &mut ids) {
                    cached += ids.len() - before;
                } else {
                    self.encode_segment(piece, segment, &mut ids)?;
                    self.cache.insert(hash, piece, &ids[before..]);
                }
            } else {
                self.encode_segment(piece, segment, &mut ids)?;
            }
        }
        if let Some(wrap) = wrap {
            ids.extend_from_slice(&wrap.suffix);
        }
        Ok((ids, cached))
    }

    /// Encodes one segment (without special tokens) onto `out`: through the
    /// fast route when it applies, else the `tokenizers` pipeline.
    fn encode_segment(
        &self,
        piece: &str,
        segment: &Segment,
        out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        if let Some(fast) = &self.fast
            && segment.plain
        {
            let before = out.len();
            let lead = segment.lead.map_or(0, |(_, len)| len);
            if let Some((id, _)) = segment.lead {
                out.push(id);
            }
            return fast
                .encode_plain(self.inner.get_model(), &piece[lead..], out)
                .map_err(|e| {
                    out.truncate(before);
                    Error::Tokenizer(e.to_string())
                });
        }
        let encoding = self
            .inner
            .encode_fast(piece, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }

    /// Decodes ids as vLLM's `/detokenize` does (`decode` keeping special
    /// tokens, then transformers' `clean_up_tokenization_spaces` when the
    /// config asks for it).
    ///
    /// # Errors
    ///
    /// [`Error::Tokenizer`] if the decoder fails.
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        let text = self
            .inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(if self.clean_up_tokenization_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// The token strings of ids (`convert_ids_to_tokens`, vLLM's
    /// `token_strs`); `None` for ids outside the vocabulary.
    pub fn token_strs(&self, ids: &[u32]) -> Vec<Option<String>> {
        ids.iter().map(|&id| self.inner.id_to_token(id)).collect()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string, if in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// transformers' `special_tokens_map` (also the template's globals).
    pub fn special_tokens_map(&self) -> &Map<String, Json> {
        &self.special_tokens_map
    }

    /// The BOS token's id, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The EOS token's id, if the model has one.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// `model_max_length` from the config, when it is a real limit.
    pub fn model_max_length(&self) -> Option<u64> {
        self.model_max_length
    }

    /// Whether plain text takes the fast route past the `tokenizers`
    /// pipeline (same ids; see the crate docs). Informational.
    pub fn has_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// Whether chat requests can be rendered.
    pub fn has_chat_template(&self) -> bool {
        !self.templates.is_empty()
    }

    /// The segment cache's counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Empties the segment cache.
    pub fn clear_cache(&self) {
        self.cache.clear();
    }

    /// The underlying `tokenizers` tokenizer (truncation and padding off,
    /// post-processor as transformers would set it).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// vLLM's `truncate_prompt_tokens`: keep the last `k` ids.
fn truncate_left(ids: &mut Vec<u32>, keep: Option<usize>) {
    if let Some(k) = keep
        && ids.len() > k
    {
        ids.drain(..ids.len() - k);
    }
}

/// The post-processor's additions around one sequence, found by
/// post-processing a single sentinel token. `None` if the result is not
/// "prefix, sentinel, suffix" (then the pipeline post-processes each time).
fn special_wrap(tokenizer: &tokenizers::Tokenizer) -> Option<SpecialWrap> {
    const SENTINEL: u32 = u32::MAX;
    let probe = Encoding::from_tokens(vec![Token::new(SENTINEL, String::new(), (0, 0))], 0);
    let processed = tokenizer.post_process(probe, None, true).ok()?;
    let ids = processed.get_ids();
    let at = ids.iter().position(|&id| id == SENTINEL)?;
    if ids.iter().filter(|&&id| id == SENTINEL).count() != 1 {
        return None;
    }
    Some(SpecialWrap {
        prefix: ids[..at].to_vec(),
        suffix: ids[at + 1..].to_vec(),
    })
}

/// The post-processor transformers' Llama-family tokenizers install:
/// `[bos] $A [eos]` per the flags.
fn bos_eos_processor(
    tokenizer: &tokenizers::Tokenizer,
    config: &TokenizerConfig,
    add_bos: bool,
    add_eos: bool,
) -> Result<TemplateProcessing, LoadError> {
    let bad = |field: &str, problem: String| LoadError::Field {
        file: crate::load::TOKENIZER_CONFIG_JSON,
        field: field.to_owned(),
        problem,
    };
    let mut special = Vec::new();
    let mut wrap = |flag: bool, attr: &str| -> Result<Option<String>, LoadError> {
        if !flag {
            return Ok(None);
        }
        let flag_name = format!("add_{attr}");
        let token = config
            .special_token(attr)
            .ok_or_else(|| bad(&flag_name, format!("is true but `{attr}` is not set")))?;
        let id = tokenizer
            .token_to_id(token)
            .ok_or_else(|| bad(attr, format!("`{token}` is not in the vocabulary")))?;
        special.push((token.to_owned(), id));
        Ok(Some(token.to_owned()))
    };
    let bos = wrap(add_bos, "bos_token")?;
    let eos = wrap(add_eos, "eos_token")?;
    let piece = |t: &Option<String>, type_id: u8| {
        t.as_ref()
            .map(|t| format!("{t}:{type_id} "))
            .unwrap_or_default()
    };
    let single = format!("{}$A:0 {}", piece(&bos, 0), piece(&eos, 0));
    let pair = format!(
        "{}$A:0 {}{}$B:1 {}",
        piece(&bos, 0),
        piece(&eos, 0),
        piece(&bos, 1),
        piece(&eos, 1)
    );
    let pp_error = |e: &dyn std::fmt::Display| {
        LoadError::Tokenizer(format!(
            "post-processor from add_bos_token/add_eos_token: {e}"
        ))
    };
    let mut builder = TemplateProcessing::builder();
    builder
        .try_single(single.trim_end())
        .map_err(|e| pp_error(&e))?;
    builder
        .try_pair(pair.trim_end())
        .map_err(|e| pp_error(&e))?;
    builder.special_tokens(special);
    builder.build().map_err(|e| pp_error(&e))
}

/// transformers' `clean_up_tokenization`.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}
