//! The word-level benchmark tokenizer: the committed copy matches the
//! generator, it loads through the normal path, and one word is one token.

use std::path::PathBuf;

use kinference_tokenize::{
    Endpoint, ModelFiles, ModelTokenizer, Options, TOKENIZER_CONFIG_JSON, TOKENIZER_JSON,
    word_level,
};
use serde_json::json;

fn committed_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/word-level")
}

#[test]
fn committed_files_match_the_generator() {
    for (name, generated) in [
        (TOKENIZER_JSON, word_level::tokenizer_json()),
        (TOKENIZER_CONFIG_JSON, word_level::tokenizer_config_json()),
    ] {
        let path = committed_dir().join(name);
        let committed =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            committed == generated,
            "{} is out of date: run `cargo run -p kinference-tokenize --example word_level -- examples/word-level`",
            path.display()
        );
    }
}

#[test]
fn one_word_is_one_token() {
    let tok = ModelTokenizer::from_dir(committed_dir()).unwrap();
    let vocab = word_level::vocabulary();
    assert_eq!(tok.vocab_size(), vocab.len());
    assert!(vocab.len() > 66_000, "{}", vocab.len());

    let prompt = word_level::numbered_words(65_530, 12);
    let ids = tok.encode(&prompt, true).unwrap();
    assert_eq!(ids.len(), 12);
    assert_eq!(ids[0], word_level::NUMBERED_WORD_BASE + 65_530);
    assert_eq!(ids[6], word_level::NUMBERED_WORD_BASE);
    assert_eq!(
        tok.token_to_id("w65535"),
        Some(word_level::NUMBERED_WORD_BASE + 65_535)
    );

    let ids = tok
        .encode("The quick brown fox, 42 ... zzz!", false)
        .unwrap();
    let unk = 0;
    assert_eq!(ids.len(), 9);
    assert_eq!(
        ids.iter().filter(|&&id| id == unk).count(),
        3,
        "brown, fox and zzz are not words here"
    );
    assert_eq!(
        tok.decode(&tok.encode("hello world .", false).unwrap())
            .unwrap(),
        "hello world ."
    );
}

#[test]
fn chat_renders_chatml() {
    let tok = word_level::load(Options::default()).unwrap();
    let out = tok
        .tokenize(
            Endpoint::ChatCompletions,
            &json!({"messages": [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "hello w3"}]}),
        )
        .unwrap();
    assert_eq!(
        out.prompt.as_deref(),
        Some(
            "<|im_start|>system\nw1 w2<|im_end|>\n<|im_start|>user\nhello w3<|im_end|>\n<|im_start|>assistant\n"
        )
    );
    let w = |n: u32| word_level::NUMBERED_WORD_BASE + n;
    let system = tok.token_to_id("system").unwrap();
    let user = tok.token_to_id("user").unwrap();
    let assistant = tok.token_to_id("assistant").unwrap();
    let hello = tok.token_to_id("hello").unwrap();
    assert_eq!(
        out.token_ids,
        vec![vec![
            3,
            system,
            w(1),
            w(2),
            4,
            3,
            user,
            hello,
            w(3),
            4,
            3,
            assistant
        ]]
    );
    assert_eq!(tok.eos_token_id(), Some(4));
    assert_eq!(tok.bos_token_id(), Some(1));
}

/// transformers rebuilds the post-processor of Llama-family tokenizers from
/// `add_bos_token`/`add_eos_token`; the raw tokenizer.json adds nothing.
#[test]
fn llama_family_classes_add_bos_and_eos() {
    let load = |config: serde_json::Value| {
        ModelTokenizer::load(
            &ModelFiles::from_entries([
                (TOKENIZER_JSON, word_level::tokenizer_json().into_bytes()),
                (TOKENIZER_CONFIG_JSON, config.to_string().into_bytes()),
            ]),
            Options::default(),
        )
    };
    let w1 = word_level::NUMBERED_WORD_BASE + 1;
    let plain = load(json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "add_bos_token": true})).unwrap();
    assert_eq!(plain.encode("w1", true).unwrap(), vec![w1]);
    let llama = load(
        json!({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}),
    )
    .unwrap();
    assert_eq!(llama.encode("w1", true).unwrap(), vec![1, w1]);
    assert_eq!(llama.encode("w1", false).unwrap(), vec![w1]);
    assert_eq!(llama.encode_uncached("w1", true).unwrap(), vec![1, w1]);
    let both = load(json!({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "add_eos_token": true})).unwrap();
    assert_eq!(
        both.encode("w1 <|im_end|> w1", true).unwrap(),
        vec![1, w1, 4, w1, 2]
    );
    let none = load(
        json!({"tokenizer_class": "LlamaTokenizerFast", "bos_token": null, "add_bos_token": true}),
    )
    .unwrap_err();
    assert_eq!(
        none.to_string(),
        "tokenizer_config.json: `add_bos_token` is true but `bos_token` is not set"
    );
    let missing =
        load(json!({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<nope>"})).unwrap_err();
    assert_eq!(
        missing.to_string(),
        "tokenizer_config.json: `bos_token` `<nope>` is not in the vocabulary"
    );
}
