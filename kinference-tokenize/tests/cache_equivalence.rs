//! The segment cache never changes the ids: on random multi-turn chats and
//! random texts full of special-token fragments, cached tokenization equals
//! the `tokenizers` pipeline run on the whole text, for the real tokenizers
//! and for synthetic ones built to break naive splitting (added tokens with
//! lstrip/rstrip/single_word, normalized added tokens, overlapping added
//! tokens, a normalizer, Metaspace with `prepend_scheme: first`).

use std::path::PathBuf;
use std::sync::LazyLock;

use kinference_tokenize::{
    ChatRequest, ModelFiles, ModelTokenizer, Options, TOKENIZER_CONFIG_JSON, TOKENIZER_JSON,
    word_level,
};
use proptest::prelude::*;
use serde_json::json;
use tokenizers::AddedToken;

fn model_dir(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tokenizers")
        .join(model)
}

/// A small cache, so eviction happens during the run too.
fn small_cache() -> Options {
    Options {
        cache_bytes: 256 * 1024,
        cache_shards: 4,
        ..Options::default()
    }
}

fn load(model: &str) -> ModelTokenizer {
    ModelTokenizer::load(
        &ModelFiles::read_dir(model_dir(model)).unwrap(),
        small_cache(),
    )
    .unwrap()
}

static QWEN3: LazyLock<ModelTokenizer> = LazyLock::new(|| load("qwen3"));
static NEMO: LazyLock<ModelTokenizer> = LazyLock::new(|| load("mistral-nemo-instruct-2407"));
static WORDS: LazyLock<ModelTokenizer> = LazyLock::new(|| word_level::load(small_cache()).unwrap());

/// GPT-2 plus added tokens of every kind, a lowercasing normalizer, and a
/// chat template whose turns start with the plain anchor `<|sep|>`.
static ADVERSARIAL: LazyLock<ModelTokenizer> = LazyLock::new(|| {
    let mut t = tokenizers::Tokenizer::from_file(model_dir("gpt2").join(TOKENIZER_JSON)).unwrap();
    t.with_normalizer(Some(tokenizers::normalizers::Lowercase))
        .unwrap();
    t.add_special_tokens([
        AddedToken::from("<|sep|>", true),
        AddedToken::from("<|sep|>y", true),
        AddedToken::from("x<|", true),
        AddedToken::from("<mask>", true).lstrip(true).rstrip(true),
        AddedToken::from("[w]", true).single_word(true),
        AddedToken::from(" <sp>", true),
        AddedToken::from("_u>", true),
    ])
    .unwrap();
    t.add_tokens([
        AddedToken::from("<norm>", false).normalized(true),
        AddedToken::from("<raw>", false),
    ])
    .unwrap();
    let template = "{% for m in messages %}<|sep|>{{ m.role }}: {{ m.content }}{% endfor %}{% if add_generation_prompt %}<|sep|>assistant:{% endif %}";
    let files = ModelFiles::from_entries([
        (TOKENIZER_JSON, t.to_string(false).unwrap().into_bytes()),
        (
            TOKENIZER_CONFIG_JSON,
            json!({"chat_template": template, "eos_token": "<|endoftext|>"})
                .to_string()
                .into_bytes(),
        ),
    ]);
    ModelTokenizer::load(&files, small_cache()).unwrap()
});

/// A WordLevel model behind Metaspace with `prepend_scheme: first`, whose
/// ids tell `▁a` (first piece) from `a` (later pieces).
static METASPACE: LazyLock<ModelTokenizer> = LazyLock::new(|| {
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "<sep>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "<unk>", "vocab": {
            "<unk>": 0, "<s>": 1, "<sep>": 2, "▁a": 3, "a": 4, "▁b": 5, "b": 6, "▁": 7, "▁▁": 8
        }}
    });
    let files = ModelFiles::from_entries([
        (TOKENIZER_JSON, tokenizer.to_string().into_bytes()),
        (
            TOKENIZER_CONFIG_JSON,
            json!({"chat_template": "{% for m in messages %}<sep>{{ m.content }}{% endfor %}"})
                .to_string()
                .into_bytes(),
        ),
    ]);
    ModelTokenizer::load(&files, small_cache()).unwrap()
});

/// Pieces texts are made of: prose, whitespace, Unicode that normalizers
/// touch, every model's special tokens, and fragments of them.
const FRAGMENTS: &[&str] = &[
    "hello",
    " world",
    "w17",
    " w42",
    "The",
    " quick",
    "42",
    "3.14",
    ".",
    ",",
    "!",
    "?",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    " \n ",
    "e",
    "\u{301}",
    "é",
    "Å",
    "A\u{30a}",
    "你好",
    "🍕",
    "👨\u{200d}👩",
    "\u{200b}",
    "\u{a0}",
    "'s",
    "'ll",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|im_",
    "_start|>",
    "|>",
    "<|",
    "<",
    ">",
    "[INST]",
    "[/INST]",
    "</s>",
    "<s>",
    "<SPECIAL_20>",
    "[INST",
    "<|sep|>",
    "<|sep|>y",
    "x<|",
    "x",
    "y",
    "<mask>",
    "[w]",
    "[W]",
    " <sp>",
    "<sp>",
    "_u>",
    "<norm>",
    "<NORM>",
    "<raw>",
    "<sep>",
    "a",
    "b",
    "▁",
    "user",
    "assistant",
];

fn text() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..12).prop_map(|parts| parts.concat())
}

fn conversation() -> impl Strategy<Value = Vec<(String, String)>> {
    let role = prop::sample::select(&["user", "assistant", "system", "tool"][..]);
    prop::collection::vec((role.prop_map(str::to_owned), text()), 1..7)
}

fn tokenizers() -> [(&'static str, &'static ModelTokenizer); 5] {
    [
        ("qwen3", &QWEN3),
        ("mistral-nemo", &NEMO),
        ("word-level", &WORDS),
        ("adversarial", &ADVERSARIAL),
        ("metaspace", &METASPACE),
    ]
}

/// Grows the conversation one turn at a time (a multi-turn client re-sends
/// its history), tokenizing each request through the cache.
fn check_conversation(
    tok: &ModelTokenizer,
    turns: &[(String, String)],
    add_generation_prompt: bool,
) -> Result<(), TestCaseError> {
    for n in 1..=turns.len() {
        let messages = turns[..n]
            .iter()
            .map(|(role, content)| json!({"role": role, "content": content}))
            .collect();
        let mut request = ChatRequest::new(messages);
        request.add_generation_prompt = add_generation_prompt;
        // Templates may reject a random conversation (Mistral's alternation
        // rule); then there is nothing to compare.
        let Ok(tokenized) = tok.tokenize_chat(&request) else {
            continue;
        };
        let prompt = tokenized.prompt.as_deref().unwrap_or_default();
        let reference = tok.encode_uncached(prompt, false).unwrap();
        prop_assert_eq!(&tokenized.token_ids[0], &reference, "prompt {:?}", prompt);
        request.add_special_tokens = true;
        let with_special = tok.tokenize_chat(&request).unwrap();
        prop_assert_eq!(
            &with_special.token_ids[0],
            &tok.encode_uncached(prompt, true).unwrap()
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn cached_chat_equals_uncached(turns in conversation(), add_generation_prompt in any::<bool>()) {
        for (_, tok) in tokenizers() {
            check_conversation(tok, &turns, add_generation_prompt)?;
        }
    }

    #[test]
    fn cached_text_equals_uncached(parts in prop::collection::vec(text(), 1..5)) {
        // Texts sharing prefixes, so later ones hit segments of earlier ones.
        let mut acc = String::new();
        for part in parts {
            acc.push_str(&part);
            for (name, tok) in tokenizers() {
                for add_special_tokens in [false, true] {
                    let cached = tok.encode(&acc, add_special_tokens).unwrap();
                    let reference = tok.encode_uncached(&acc, add_special_tokens).unwrap();
                    prop_assert_eq!(cached, reference, "{} {:?}", name, acc);
                }
            }
        }
    }
}

#[test]
fn anchors_actually_split_and_hit() {
    // Without this, the properties above could pass with a cache that
    // never splits: check that a re-sent conversation is served mostly
    // from the cache.
    let tok = &*QWEN3;
    let turns: Vec<_> = (0..6)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("turn {i}: some words about routing and caches")})
        })
        .collect();
    let first = tok
        .tokenize_chat(&ChatRequest::new(turns[..5].to_vec()))
        .unwrap();
    let second = tok.tokenize_chat(&ChatRequest::new(turns.clone())).unwrap();
    assert!(second.total_tokens() > first.total_tokens());
    assert!(
        second.cached_tokens * 10 >= second.total_tokens() * 7,
        "only {} of {} ids cached",
        second.cached_tokens,
        second.total_tokens()
    );
    // And the synthetic tokenizers' traps are live: these texts tokenize
    // differently from their naive concatenation.
    let naive = |tok: &ModelTokenizer, a: &str, b: &str| {
        let mut ids = tok.encode_uncached(a, false).unwrap();
        ids.extend(tok.encode_uncached(b, false).unwrap());
        ids
    };
    for (tok, a, b) in [
        (&*ADVERSARIAL, "x", "<|sep|>"),
        (&*ADVERSARIAL, "a ", "<mask>"),
        (&*ADVERSARIAL, "<|sep|>", "y"),
        (&*METASPACE, "", "a"),
    ] {
        let whole = format!("{a}{b}");
        if a.is_empty() {
            // Metaspace `first` prepends only at the start of the text.
            assert_ne!(
                tok.encode_uncached("<sep>a", false).unwrap(),
                tok.encode_uncached("a", false).unwrap()[..].to_vec()
            );
            continue;
        }
        assert_ne!(
            tok.encode_uncached(&whole, false).unwrap(),
            naive(tok, a, b),
            "{whole:?}"
        );
        assert_eq!(
            tok.encode(&whole, false).unwrap(),
            tok.encode_uncached(&whole, false).unwrap()
        );
    }
}
